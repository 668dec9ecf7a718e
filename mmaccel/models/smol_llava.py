"""Compose a LLaVA-1.5-style ``LlavaForConditionalGeneration`` from two real checkpoints and a trained projector.

The recipe of LLaVA (Liu et al., "Visual Instruction Tuning", 2023, arXiv 2304.08485) with the two-layer MLP
projector of LLaVA-1.5 (Liu et al., "Improved Baselines with Visual Instruction Tuning", 2023, arXiv 2310.03744):
a frozen vision tower, a frozen language model, and between them ``Linear -> GELU -> Linear`` mapping each patch
feature to one input embedding of the LM. Only the projector is trained (LLaVA's stage-1 "feature alignment").

``smol-llava`` uses the zoo's ``dinov2-small`` (DINOv2 ViT-S/14, hidden 384) and ``smollm2-135m`` (Llama, hidden
576); its projector has 384*576 + 576 + 576*576 + 576 = 554,112 parameters. The build (:func:`build_llava`):

- **Vision tower at 168 px.** The DINOv2 checkpoint has a 37 x 37 position grid (518 px). Its position embeddings
  are interpolated once, with the model's own ``interpolate_pos_encoding`` (bicubic, what ``Dinov2Model`` does at
  every forward for another size), to the 12 x 12 grid of a 168 px input, and the tower's config says
  ``image_size=168``. The tower then computes exactly what the 518 px checkpoint computes on a 168 px image, and
  ``vision_config.image_size // patch_size`` is the LLaVA grid (12 x 12 = 144 visual tokens per image).
- **Features** (:class:`BuildRecipe`): ``vision_feature_layer=-1``, the output of DINOv2's last block (transformers
  captures block outputs, so this is *before* ``Dinov2Model``'s final LayerNorm; token norms are about 42 on the
  scenes, no outliers), since DINOv2's last block is the one its self-distillation losses train (LLaVA-1.5 takes
  CLIP's penultimate layer because CLIP's last one is shaped by the image-level contrastive loss).
  ``vision_feature_select_strategy="default"``: DINOv2's CLS token (position 0; ViT-S/14 has no register tokens) is
  dropped and the 144 patch tokens are kept, so every visual token has a grid position.
- **Tokenizer.** The LM's tokenizer with an added special token ``<image>`` (its id is appended: 49,152 for
  SmolLM2) and the LM's embedding resized by one row, set to the mean of the other rows (the row is never read at
  an image position, which the projector fills; tied embeddings share it with the LM head).
- **Processor.** A ``LlavaProcessor`` (``patch_size=14``, ``num_additional_image_tokens=1`` for the CLS token,
  strategy ``"default"``: one ``<image>`` becomes 144) around the tower's image processor set to resize the
  shortest edge to 168 px and center-crop 168 x 168 (ImageNet mean/std), padding on the left, and a ChatML chat
  template with no default system prompt that writes ``<image>`` where the user turn holds an image.
- **Projector.** ``LlavaMultiModalProjector`` initialised from a seeded generator (weights N(0, 0.02), biases 0),
  or loaded from ``projector.safetensors`` (:func:`save_projector` / :func:`load_projector`). The file may store
  float32, bfloat16 or float16 tensors (the committed ones are bfloat16); a load casts them to the model's dtype.
- **LoRA adapters** (optional; Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021, arXiv
  2106.09685). The same file may hold low-rank updates of the LM's linear layers (``lora.<module>.A`` [r, in] and
  ``lora.<module>.B`` [out, r], the scale ``alpha / r`` in its metadata), trained with ``peft`` by
  :mod:`mmaccel.zoo.train.smol_llava`. A load merges them into the LM's weights (``W += scale * B @ A``,
  :func:`merge_lora`), so the loaded model is a plain ``LlavaForConditionalGeneration`` and needs no ``peft``.

The build is deterministic, so a committed projector plus the two fetched parts reproduce the trained model.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
PROJECTOR_FILE = "projector.safetensors"
_FORMAT = "mmaccel-llava-projector-v1"
_LORA = "lora."  # key prefix of the LM adapters stored beside the projector
#: The dtypes a projector file may store (:func:`save_projector`'s ``save_dtype``); a load casts to the model's.
SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: ChatML (SmolLM2's format) without SmolLM2's default system prompt; an ``{"type": "image"}`` item becomes
#: ``<image>`` followed by a newline, which the processor expands to the image's visual tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}" + IMAGE_TOKEN + "\n"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: :data:`CHAT_TEMPLATE` for a model trained with the question first (``BuildRecipe.question_first``): in each turn
#: the text items come first, then a newline and every image item (``<image>`` and a newline each), wherever the
#: images stand in the message, so a chat written image-first (HF's usual order) gets the trained order.
CHAT_TEMPLATE_QUESTION_FIRST = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] if item['type'] == 'text' %}{{ item['text'] }}{% endfor %}"
    "{% for item in message['content'] if item['type'] == 'image' %}{% if loop.first %}{{ '\\n' }}{% endif %}"
    + IMAGE_TOKEN + "\n{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class BuildRecipe:
    """How the parts are put together (recorded in the projector file, so a load rebuilds what was trained).

    Attributes
    ----------
    image_size : int
        Input side in pixels; a multiple of the tower's patch size (168 = 12 x 14: 144 visual tokens).
    vision_feature_layer : int
        Index into the tower's hidden states (0 = embeddings, -1 = last block's output before the final norm).
    vision_feature_select_strategy : {"default", "full"}
        ``"default"`` drops the tower's CLS token, ``"full"`` keeps it as a 145th visual token.
    projector_hidden_act : str
        Activation between the projector's two linear layers (LLaVA-1.5: GELU).
    init_std : float
        Standard deviation of the projector's initial weights (biases start at 0).
    seed : int
        Seed of the projector's initialisation.
    question_first : bool
        The chat puts each turn's text before its images (:data:`CHAT_TEMPLATE_QUESTION_FIRST`), so the visual
        tokens come after the question and can attend to it; False: images first (:data:`CHAT_TEMPLATE`, LLaVA's
        order).
    """

    image_size: int = 168
    vision_feature_layer: int = -1
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    init_std: float = 0.02
    seed: int = 0
    question_first: bool = False

    def to_json(self) -> str:
        """The recipe as a JSON object string."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BuildRecipe:
        """Inverse of :meth:`to_json`.

        Raises
        ------
        ValueError
            If ``text`` is not a JSON object of recipe fields.
        """
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not a build recipe: {text[:200]!r} ({exc})") from exc


def fit_positions(tower: nn.Module, image_size: int) -> nn.Module:
    """Resize a ViT tower's learned position embeddings, in place, to the grid of ``image_size`` pixels.

    The new table is what the tower's own ``embeddings.interpolate_pos_encoding`` computes for that input size
    (for DINOv2: bicubic in float32), so the tower's outputs do not change; only ``config.image_size`` and the stored
    table [1, 1 + G*G, D] (G = image_size // patch_size) do, which keeps ``save_pretrained`` round trips exact.

    Parameters
    ----------
    tower : nn.Module
        A Dinov2-style model: ``embeddings.position_embeddings`` (a Parameter [1, 1 + N, D]),
        ``embeddings.interpolate_pos_encoding(embeddings, height, width)`` and ``embeddings.patch_embeddings``.
    image_size : int
        Side of the square input, pixels.

    Returns
    -------
    nn.Module
        ``tower`` itself.

    Raises
    ------
    ValueError
        If ``image_size`` is not a positive multiple of the patch size, or the tower has no such position table.
    """
    emb = getattr(tower, "embeddings", None)
    table = getattr(emb, "position_embeddings", None)
    if not isinstance(table, nn.Parameter) or not hasattr(emb, "interpolate_pos_encoding"):
        raise ValueError(f"{type(tower).__name__} has no learned position table with interpolate_pos_encoding "
                         "(a Dinov2-style tower is needed)")
    patch = tower.config.patch_size
    if image_size < patch or image_size % patch:
        raise ValueError(f"image_size must be a positive multiple of the patch size {patch}, got {image_size}")
    side = image_size // patch
    with torch.no_grad():
        dummy = table.new_empty(1, 1 + side * side, table.shape[-1])
        new = emb.interpolate_pos_encoding(dummy, image_size, image_size).detach().clone()
    emb.position_embeddings = nn.Parameter(new, requires_grad=table.requires_grad)
    patches = emb.patch_embeddings
    patches.image_size = (image_size, image_size)
    patches.num_patches = side * side
    tower.config.image_size = image_size
    return tower


def add_image_token(lm: nn.Module, tokenizer) -> int:
    """Give the LM an embedding row for the tokenizer's ``<image>`` token, set to the mean of the existing rows.

    A tokenizer that already had ``<image>`` inside the LM's vocabulary (``micro-lm`` reserves id 3) keeps it: the
    LM is not resized (the row is never read at image positions, which the projector fills).

    Parameters
    ----------
    lm : transformers.PreTrainedModel
        A causal LM whose vocabulary is one token short of ``len(tokenizer)``, or one that already holds the
        tokenizer's ``<image>`` id.
    tokenizer
        The LM's tokenizer loaded with ``extra_special_tokens={"image_token": "<image>"}``.

    Returns
    -------
    int
        The ``<image>`` token id (the appended last one, or the LM's own).

    Raises
    ------
    ValueError
        If the tokenizer's ``<image>`` id is neither inside the LM's vocabulary nor appended at its end.
    """
    old = lm.get_input_embeddings().weight.shape[0]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if len(tokenizer) == old and image_id is not None and 0 <= image_id < old \
            and image_id != tokenizer.unk_token_id:
        return image_id
    if image_id != old or len(tokenizer) != old + 1:
        raise ValueError(f"expected {IMAGE_TOKEN} appended as id {old} (vocabulary {old}); the tokenizer gives id "
                         f"{image_id} and {len(tokenizer)} tokens")
    lm.resize_token_embeddings(old + 1, mean_resizing=False)
    with torch.no_grad():
        emb = lm.get_input_embeddings().weight
        emb[old:] = emb[:old].mean(0)
        head = lm.get_output_embeddings()
        if head is not None and head.weight is not emb:
            head.weight[old:] = head.weight[:old].mean(0)
    return image_id


def chat_template(recipe: BuildRecipe) -> str:
    """The processor's chat template for ``recipe``: :data:`CHAT_TEMPLATE_QUESTION_FIRST` when
    ``recipe.question_first``, else :data:`CHAT_TEMPLATE`."""
    return CHAT_TEMPLATE_QUESTION_FIRST if recipe.question_first else CHAT_TEMPLATE


def build_processor(vision_dir, language_dir, recipe: BuildRecipe = BuildRecipe(), *, patch_size: int | None = None,
                    projector: str | Path | None = None):
    """The ``LlavaProcessor`` of a composed model: the LM's tokenizer plus ``<image>``, the tower's image processor.

    Loads no weights (a second or two).

    Parameters
    ----------
    vision_dir, language_dir : path
        Checkpoint folders of the tower (with ``preprocessor_config.json``) and of the LM (with its tokenizer).
    recipe : BuildRecipe
        Image size and feature strategy.
    patch_size : int, optional
        The tower's patch size (default: read from its ``config.json``).
    projector : path, optional
        A projector file; its recorded recipe replaces ``recipe``.

    Returns
    -------
    transformers.LlavaProcessor
        Left padding; images resized (shortest edge) and center-cropped to ``recipe.image_size`` pixels, rescaled
        and normalised with the tower's mean and std: ``pixel_values`` [B, 3, S, S] float32. One ``<image>`` in the
        text becomes ``(S // patch)**2`` tokens (plus one with ``"full"``). Chat template: :data:`CHAT_TEMPLATE`, or
        :data:`CHAT_TEMPLATE_QUESTION_FIRST` when ``recipe.question_first``.

    Raises
    ------
    FileNotFoundError, ValueError
        A ``projector`` file that is missing or was not written by :func:`save_projector`.
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, LlavaProcessor

    if projector is not None:
        recipe = read_projector_recipe(projector)
    if patch_size is None:
        patch_size = AutoConfig.from_pretrained(vision_dir, trust_remote_code=False).patch_size
    side = recipe.image_size
    image_processor = AutoImageProcessor.from_pretrained(
        vision_dir, size={"shortest_edge": side}, crop_size={"height": side, "width": side}, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(language_dir, extra_special_tokens={"image_token": IMAGE_TOKEN},
                                              padding_side="left", trust_remote_code=False)
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                          vision_feature_select_strategy=recipe.vision_feature_select_strategy,
                          num_additional_image_tokens=1, chat_template=chat_template(recipe))


def build_llava(
    vision_dir,
    language_dir,
    *,
    recipe: BuildRecipe = BuildRecipe(),
    projector: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
):
    """Compose a ``LlavaForConditionalGeneration`` from a vision-tower checkpoint and a causal-LM checkpoint.

    The model is assembled from the loaded parts (no weight is copied or randomly initialised except the projector):
    a ``LlavaForConditionalGeneration`` skeleton is made on the meta device and its vision tower, language model and
    LM head are the parts' modules.

    Parameters
    ----------
    vision_dir : path
        A Dinov2-style ``AutoModel`` checkpoint with an image processor (``dinov2-small``'s cached folder).
    language_dir : path
        A causal LM checkpoint with a ChatML tokenizer (``smollm2-135m``'s cached folder).
    recipe : BuildRecipe
        Image size, feature layer and strategy, projector activation and initialisation. Ignored for those fields
        when ``projector`` is given: its file records the recipe it was trained with, and that one is used.
    projector : path, optional
        A ``projector.safetensors`` written by :func:`save_projector`; default: a fresh seeded projector.
    dtype : torch.dtype
        Parameter dtype of the whole model.
    attn_implementation : str
        For the tower and the LM (``"sdpa"``, ``"eager"``, ...).

    Returns
    -------
    (transformers.LlavaForConditionalGeneration, transformers.LlavaProcessor)
        The model in eval mode on the CPU, and its processor (:func:`build_processor`).

    Raises
    ------
    ValueError
        A bad image size, a tokenizer whose ``<image>`` id is not appended, or a projector file that does not fit
        the parts (:func:`load_projector`).
    """
    from transformers import AutoModel, AutoModelForCausalLM, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    if projector is not None:
        recipe = read_projector_recipe(projector)
    kw = {"dtype": dtype, "attn_implementation": attn_implementation, "trust_remote_code": False}
    tower = fit_positions(AutoModel.from_pretrained(vision_dir, **kw), recipe.image_size)
    lm = AutoModelForCausalLM.from_pretrained(language_dir, **kw)
    processor = build_processor(vision_dir, language_dir, recipe, patch_size=tower.config.patch_size)
    image_id = add_image_token(lm, processor.tokenizer)
    config = LlavaConfig(
        vision_config=tower.config,
        text_config=lm.config,
        image_token_id=image_id,
        vision_feature_layer=recipe.vision_feature_layer,
        vision_feature_select_strategy=recipe.vision_feature_select_strategy,
        projector_hidden_act=recipe.projector_hidden_act,
        multimodal_projector_bias=True,
    )
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model.model.vision_tower = tower
    model.model.language_model = lm.model
    model.lm_head = lm.lm_head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        proj = LlavaMultiModalProjector(config)
        for layer in (proj.linear_1, proj.linear_2):
            nn.init.normal_(layer.weight, std=recipe.init_std)
            nn.init.zeros_(layer.bias)
    model.model.multi_modal_projector = proj.to(dtype)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"composition left tensors on the meta device: {left[:5]}")
    model.generation_config = copy.deepcopy(lm.generation_config)
    model.set_attn_implementation(attn_implementation)
    if projector is not None:
        load_projector(model, projector)
        merge_lora(model, projector)
    return model.eval(), processor


def projector_of(model) -> nn.Module:
    """The ``multi_modal_projector`` of a LLaVA model (``LlavaForConditionalGeneration`` or ``LlavaModel``)."""
    inner = getattr(model, "model", model)
    return inner.multi_modal_projector


def save_projector(model, path: str | Path, *, parts: dict | None = None, recipe: BuildRecipe = BuildRecipe(),
                   lora: dict | None = None, save_dtype: torch.dtype = torch.float32) -> Path:
    """Write the projector's weights (safetensors) with the build recipe and the parts in its metadata.

    Parameters
    ----------
    model : LlavaForConditionalGeneration
    path : path
        The file to write (``.../projector.safetensors``); its folder is created.
    parts : dict, optional
        What it was trained on, e.g. ``{"vision": {"name": "dinov2-small", "sha256": ...}, ...}``.
    recipe : BuildRecipe
        The recipe the model was built with.
    lora : dict, optional
        LM adapters to store beside the projector (:func:`lora_state`): ``{"scale": float, "rank": int, "alpha":
        float, "modules": {LM module name: (A [r, in], B [out, r])}}``.
    save_dtype : torch.dtype
        The stored dtype of every tensor, one of :data:`SAVE_DTYPES` (default float32: 4 bytes per parameter;
        bfloat16 or float16 halve the file). :func:`load_projector` and :func:`merge_lora` cast back on load.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        If ``save_dtype`` is not one of :data:`SAVE_DTYPES` (raised before anything is written).
    """
    from safetensors.torch import save_file

    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"save_dtype must be one of {', '.join(map(str, SAVE_DTYPES))}; got {save_dtype!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(save_dtype).contiguous().cpu() for k, v in projector_of(model).state_dict().items()}
    meta = {"format": _FORMAT, "recipe": recipe.to_json(), "parts": json.dumps(parts or {}, sort_keys=True)}
    if lora:
        for name, (a, b) in lora["modules"].items():
            tensors[f"{_LORA}{name}.A"] = a.detach().to(save_dtype).contiguous().cpu()
            tensors[f"{_LORA}{name}.B"] = b.detach().to(save_dtype).contiguous().cpu()
        meta["lora"] = json.dumps({k: lora[k] for k in ("scale", "rank", "alpha")}, sort_keys=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def lora_state(language_model: nn.Module, adapter: str = "default") -> dict:
    """The LoRA factors that ``peft`` injected into a language model, in the form :func:`save_projector` stores.

    Parameters
    ----------
    language_model : nn.Module
        The LM (``model.model.language_model``) after ``peft.inject_adapter_in_model``.
    adapter : str
        The adapter's name in ``peft``.

    Returns
    -------
    dict
        ``{"scale", "rank", "alpha", "modules": {module name: (A [r, in], B [out, r])}}`` (tensors detached).

    Raises
    ------
    ValueError
        If the model holds no LoRA layer, or their ranks or scales differ.
    """
    modules, scales, ranks, alphas = {}, set(), set(), set()
    for name, mod in language_model.named_modules():
        lora_a = getattr(mod, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and adapter in lora_a:
            a, b = lora_a[adapter].weight, mod.lora_B[adapter].weight
            modules[name] = (a.detach().clone(), b.detach().clone())
            scales.add(float(mod.scaling[adapter]))
            ranks.add(int(a.shape[0]))
            alphas.add(float(mod.lora_alpha[adapter]))
    if not modules or len(scales) != 1 or len(ranks) != 1:
        raise ValueError(f"expected LoRA layers of one rank and scale in the language model; found {len(modules)} "
                         f"layers, ranks {sorted(ranks)}, scales {sorted(scales)}")
    return {"scale": scales.pop(), "rank": ranks.pop(), "alpha": alphas.pop(), "modules": modules}


def read_lora(path: str | Path) -> dict | None:
    """The LoRA adapters stored in a projector file, in :func:`lora_state`'s form, or ``None`` when it holds none.

    Returns
    -------
    dict or None
        ``{"scale", "rank", "alpha", "modules": {LM module name: (A [r, in], B [out, r])}}``, float32 tensors (cast
        from the stored dtype, see :data:`SAVE_DTYPES`).

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`read_projector_recipe`.
    """
    from safetensors import safe_open

    info = read_projector_lora(path)
    if not info:
        return None
    with safe_open(str(path), "pt") as f:
        keys = f.keys()  # a safe_open handle has no __iter__
        names = sorted(k[len(_LORA):-2] for k in keys if k.startswith(_LORA) and k.endswith(".A"))
        modules = {n: (f.get_tensor(f"{_LORA}{n}.A").float(), f.get_tensor(f"{_LORA}{n}.B").float()) for n in names}
    return {**info, "modules": modules}


def stack_lora(first: dict, then: dict) -> dict:
    """One set of LoRA adapters whose update is the sum of two: ``then`` trained on top of ``first`` merged.

    For each module, ``A = [A1; A2]`` and ``B = [B1 * s1 / s2, B2]`` with ``scale = s2``, so ``scale * B @ A =
    s1 * B1 @ A1 + s2 * B2 @ A2`` (exact up to float rounding); the rank is ``r1 + r2`` and ``alpha = s2 * rank``.
    This is how a run that starts from a file with adapters (``init_projector``) stores what a load must merge.

    Parameters
    ----------
    first, then : dict
        In :func:`lora_state`'s form.

    Returns
    -------
    dict
        In :func:`lora_state`'s form.

    Raises
    ------
    ValueError
        If the two do not adapt the same modules, or a module's factor shapes do not chain.
    """
    if set(first["modules"]) != set(then["modules"]):
        raise ValueError(f"the two adapter sets adapt different modules: "
                         f"{sorted(set(first['modules']) ^ set(then['modules']))[:4]}")
    ratio = first["scale"] / then["scale"]
    modules = {}
    for name, (a2, b2) in then["modules"].items():
        a1, b1 = first["modules"][name]
        if a1.shape[1] != a2.shape[1] or b1.shape[0] != b2.shape[0]:
            raise ValueError(f"the adapters of {name!r} do not chain: {tuple(b1.shape)} x {tuple(a1.shape)} then "
                             f"{tuple(b2.shape)} x {tuple(a2.shape)}")
        modules[name] = (torch.cat([a1.float(), a2.float().to(a1.device)]),
                         torch.cat([b1.float() * ratio, b2.float().to(b1.device)], dim=1))
    rank = first["rank"] + then["rank"]
    return {"scale": then["scale"], "rank": rank, "alpha": then["scale"] * rank, "modules": modules}


@torch.no_grad()
def merge_lora(model, path: str | Path) -> int:
    """Merge the LoRA factors stored in a projector file into the LM's weights: ``W += scale * B @ A``.

    Parameters
    ----------
    model : LlavaForConditionalGeneration
    path : path
        A file written by :func:`save_projector` (one without adapters changes nothing).

    Returns
    -------
    int
        How many linear layers were updated (0 when the file holds no adapters).

    Raises
    ------
    ValueError
        If a stored module is not a linear layer of this LM, or its factors' shapes do not fit it.
    """
    lora = read_lora(path)
    if not lora:
        return 0
    lm = model.model.language_model
    for name, (a, b) in lora["modules"].items():
        try:
            layer = lm.get_submodule(name)
        except AttributeError:
            layer = None
        if not isinstance(layer, nn.Linear) or tuple(layer.weight.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(f"{path}: the LoRA factors of {name!r} ({tuple(b.shape)} x {tuple(a.shape)}) do not fit "
                             f"this language model: it was trained for other parts")
        delta = lora["scale"] * (b @ a)
        layer.weight.copy_((layer.weight.to(torch.float32) + delta.to(layer.weight.device)).to(layer.weight.dtype))
    return len(lora["modules"])


def _metadata(path: str | Path) -> dict:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no projector file at {path}")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types on bad headers
        raise ValueError(f"{path} is not a safetensors file ({exc})") from exc
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path} is not an mmaccel LLaVA projector (metadata format {meta.get('format')!r})")
    return meta


def read_projector_lora(path: str | Path) -> dict | None:
    """The LoRA metadata of a projector file (``{"scale", "rank", "alpha"}``), or ``None`` when it holds no adapters.

    Raises
    ------
    FileNotFoundError
        If there is no file at ``path``.
    """
    return json.loads(_metadata(path).get("lora", "null") or "null")


def read_projector_recipe(path: str | Path) -> BuildRecipe:
    """The :class:`BuildRecipe` recorded in a projector file.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        If it is not a projector written by :func:`save_projector`.
    """
    return BuildRecipe.from_json(_metadata(path)["recipe"])


def read_projector_parts(path: str | Path) -> dict:
    """The ``parts`` dict recorded in a projector file (empty when none was recorded). Errors as
    :func:`read_projector_recipe`."""
    return json.loads(_metadata(path).get("parts", "{}"))


def load_projector(model, path: str | Path) -> None:
    """Load projector weights written by :func:`save_projector` into ``model``.

    The stored tensors (float32, bfloat16 or float16, :data:`SAVE_DTYPES`) are cast to the dtype and device of the
    model's projector before they are copied in, so a bfloat16 file loads into a float32 model as float32 weights.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        If it is not a projector file, a tensor's dtype is not one of :data:`SAVE_DTYPES`, or its tensors' names or
        shapes differ from the model's projector (it was trained for other parts).
    """
    from safetensors.torch import load_file

    _metadata(path)
    proj = projector_of(model)
    state = {k: v for k, v in load_file(str(path)).items() if not k.startswith(_LORA)}
    odd = {k: str(v.dtype) for k, v in state.items() if v.dtype not in SAVE_DTYPES}
    if odd:
        raise ValueError(f"{path} stores tensors of a dtype a projector cannot hold ({odd}); expected one of "
                         f"{', '.join(map(str, SAVE_DTYPES))}: rewrite it with save_projector")
    mine = proj.state_dict()
    bad = sorted(set(state) ^ set(mine)) or [k for k in mine if tuple(state[k].shape) != tuple(mine[k].shape)]
    if bad:
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        raise ValueError(f"{path} does not fit this model's projector (mismatched: {bad}; file holds {shapes}, the "
                         f"model wants {({k: tuple(v.shape) for k, v in mine.items()})}): it was trained for other parts")
    ref = next(iter(mine.values()))
    proj.load_state_dict({k: v.to(dtype=ref.dtype, device=ref.device) for k, v in state.items()})


def image_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """The vision tower's features that the projector reads, as ``LlavaModel.get_image_features`` selects them.

    Parameters
    ----------
    model : LlavaForConditionalGeneration
    pixel_values : torch.Tensor
        [B, 3, S, S] from the processor.

    Returns
    -------
    torch.Tensor
        [B, N, D_vision]: hidden states of ``config.vision_feature_layer``, without the CLS token under strategy
        ``"default"`` (N = (S // patch)**2 = 144 for ``smol-llava``). Cache them: the tower is frozen.
    """
    cfg = model.config
    out = model.model.vision_tower(pixel_values.to(model.dtype), output_hidden_states=True, return_dict=True)
    feats = out.hidden_states[cfg.vision_feature_layer]
    return feats[:, 1:] if cfg.vision_feature_select_strategy == "default" else feats


def embed_with_features(model, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Input embeddings with the projected image features on the ``<image>`` positions (LLaVA's merge).

    Together with :func:`image_features` this is ``LlavaModel.forward``'s own path split in two, so that training
    can reuse cached tower features: ``model(inputs_embeds=embed_with_features(model, ids, image_features(model,
    px)), ...)`` gives the logits of ``model(input_ids=ids, pixel_values=px, ...)``.

    Parameters
    ----------
    input_ids : torch.Tensor
        [B, L] with N ``<image>`` tokens per image, images in order.
    features : torch.Tensor
        [I, N, D_vision] tower features of the I images of the batch, in order of appearance.

    Returns
    -------
    torch.Tensor
        [B, L, D_text]; differentiable with respect to the projector's parameters.

    Raises
    ------
    ValueError
        If the number of ``<image>`` tokens differs from I * N.
    """
    embeds = model.get_input_embeddings()(input_ids)
    mask = input_ids == model.config.image_token_id
    projected = projector_of(model)(features.to(embeds.dtype)).reshape(-1, embeds.shape[-1])
    if int(mask.sum()) != projected.shape[0]:
        raise ValueError(f"the ids hold {int(mask.sum())} {IMAGE_TOKEN} tokens but the features give "
                         f"{projected.shape[0]} visual tokens ({tuple(features.shape[:2])})")
    return embeds.masked_scatter(mask.unsqueeze(-1), projected.to(embeds.dtype))  # autocast runs the projector in bf16
