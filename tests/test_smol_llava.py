"""smol-llava's build, projector training and loading, on tiny random parts that go through the real build code.

The parts are a 2-layer Dinov2 (hidden 32, a 7 x 7 position grid, so the 168 px build must interpolate) with a
``BitImageProcessor``, and a 2-layer Llama (hidden 32, tied embeddings) with a ChatML-style BPE tokenizer, both saved
as checkpoint folders like the zoo's fetched ``dinov2-small`` and ``smollm2-135m``. The Llama is initialised with
std 0.2 (not 0.02) so that its logits can be confident and a projector can steer it.
"""
import dataclasses
import json

import pytest
import torch
from transformers import (
    AutoProcessor,
    BitImageProcessor,
    Dinov2Config,
    Dinov2Model,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

import mmaccel
from mmaccel.data.scenes import ANSWERS, describe_scene, make_scene_qa
from mmaccel.models import built as built_mod
from mmaccel.models import smol_llava as sl
from mmaccel.models.loading import ModelLoadError, load_tokenizer
from mmaccel.zoo.train import smol_llava as tr

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(vision_dir, language_dir): tiny random Dinov2 and Llama checkpoints with their processor and tokenizer."""
    root = tmp_path_factory.mktemp("smol-llava-parts")
    torch.manual_seed(0)
    vision = Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      image_size=98, patch_size=14))
    vision.save_pretrained(root / "vision")
    BitImageProcessor(size={"shortest_edge": 112}, crop_size={"height": 98, "width": 98},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(root / "vision")
    texts = [f"{q.question} {tr.INSTRUCTION} {q.answer}" for q in make_scene_qa(30, seed=0)] + list(ANSWERS)
    tokenizer = _tokenizer(texts)
    tokenizer.save_pretrained(root / "language")
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=2))
    lm.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    lm.save_pretrained(root / "language")
    return root / "vision", root / "language"


@pytest.fixture(scope="module")
def built(parts):
    return sl.build_llava(*parts)


def _inputs(processor, qas):
    texts = [processor.apply_chat_template(tr.messages(q.question), add_generation_prompt=True, tokenize=False)
             for q in qas]
    return processor(images=[q.image for q in qas], text=texts, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def batch(built):
    """Two held-out questions of different lengths (so row 0 or 1 is left-padded)."""
    qas = make_scene_qa(5, seed=0, split="test")
    qas = [qas[0], qas[3]]  # a colour question and a relation question
    inputs = _inputs(built[1], qas)
    assert (inputs["attention_mask"] == 0).any()
    return qas, inputs


def _logits(model, inputs):
    pos = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(**inputs, position_ids=pos).logits


# ------------------------------------------------------------------------------------------------------------ build
def test_build_recipe_grid_tokens_and_tower_positions(parts, built):
    model, processor = built
    cfg = model.config
    assert isinstance(model, LlavaForConditionalGeneration)
    assert cfg.vision_config.image_size // cfg.vision_config.patch_size == 12
    assert (cfg.vision_feature_layer, cfg.vision_feature_select_strategy) == (-1, "default")
    # <image> is appended, its embedding row is the mean of the others, and the LM head still shares the table
    lm_vocab = LlamaForCausalLM.from_pretrained(parts[1]).config.vocab_size
    assert cfg.image_token_id == lm_vocab == processor.tokenizer.convert_tokens_to_ids("<image>")
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == lm_vocab + 1 and model.lm_head.weight is emb
    torch.testing.assert_close(emb[-1], emb[:-1].mean(0))
    # one <image> in the prompt -> 144 tokens; pixels are 168 x 168
    inputs = _inputs(processor, make_scene_qa(1, seed=0))
    assert int((inputs["input_ids"] == cfg.image_token_id).sum()) == 144
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 168, 168)
    # the resized position table computes what the 98 px checkpoint computes on a 168 px input
    original = Dinov2Model.from_pretrained(parts[0]).eval()
    assert original.embeddings.position_embeddings.shape[1] == 1 + 49
    assert model.model.vision_tower.embeddings.position_embeddings.shape[1] == 1 + 144
    with torch.no_grad():
        ref = original(inputs["pixel_values"]).last_hidden_state
        got = model.model.vision_tower(inputs["pixel_values"]).last_hidden_state
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # the visual-token methods see a 12 x 12 LLaVA grid with no prefix token
    from mmaccel.vision_tokens import VLMParts

    found = VLMParts.find(model)
    assert found.kind == "llava" and [(g.h, g.w, g.prefix) for g in found.grids(144, None)] == [(12, 12, 0)]


def test_generate_is_greedy_on_the_image_and_question(built, batch):
    model, processor = built
    qas, inputs = batch
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    assert out.shape == (2, 3)
    logits = _logits(model, inputs)
    assert out[:, 0].tolist() == logits[:, -1].argmax(-1).tolist()
    # the image matters: another scene under the same question changes the next-token distribution
    other = _inputs(processor, [dataclasses.replace(qas[0], image=make_scene_qa(9, seed=1)[8].image), qas[1]])
    assert not torch.allclose(_logits(model, other)[0, -1], logits[0, -1])


def test_projected_features_land_on_the_image_positions(built, batch):
    model, _ = built
    _, inputs = batch
    seen = []

    def capture(module, args, kwargs):
        seen.append(kwargs["inputs_embeds"].detach().clone())

    hook = model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
            ref = model.model.get_image_features(inputs["pixel_values"]).pooler_output  # HF's own path, per image
            mine = sl.projector_of(model)(sl.image_features(model, inputs["pixel_values"]))
    finally:
        hook.remove()
    ids = inputs["input_ids"]
    mask = ids == model.config.image_token_id
    assert mask.sum(1).tolist() == [144, 144]
    embeds = seen[0]
    torch.testing.assert_close(embeds[mask].view(2, 144, -1), torch.stack(list(ref)), rtol=0, atol=0)
    torch.testing.assert_close(mine, torch.stack(list(ref)), rtol=0, atol=1e-6)
    with torch.no_grad():
        text = model.get_input_embeddings()(ids)
    assert torch.equal(embeds[~mask], text[~mask])


def test_cached_feature_path_gives_the_models_logits(built, batch):
    model, processor = built
    qas, inputs = batch
    examples, images = tr.encode_examples(processor, qas)
    prompt_len = inputs["attention_mask"].sum(1).tolist()
    assert [len(e.input_ids) - e.n_target for e in examples] == prompt_len
    feats = tr.cache_features(model, processor, images)
    assert tuple(feats.shape) == (2, 144, 32)
    b = tr.collate(examples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        embeds = sl.embed_with_features(model, b["input_ids"], feats[b["images"]])
        got = model(inputs_embeds=embeds, attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
        ref = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                    pixel_values=inputs["pixel_values"]).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # the targets are exactly the answer tokens and EOS, at the end of each row
    for row, e in zip(b["labels"], examples):
        assert row[row != -100].tolist() == e.input_ids[-e.n_target:] and row[-e.n_target:].ne(-100).all()
        assert e.input_ids[-1] == processor.tokenizer.eos_token_id


def test_multi_turn_conversations_put_one_image_before_several_answers(built):
    """``turns=3``: one scene's three questions share one copy of its visual tokens; turn 1 is the single-question
    prompt; labels mark every answer and its EOS; the loss (LM head on target positions only) equals the
    cross-entropy gathered from the full model's logits."""
    model, processor = built
    qas = make_scene_qa(6, seed=5, per_scene=3)
    single, _ = tr.encode_examples(processor, qas)
    multi, images = tr.encode_examples(processor, qas, turns=3)
    assert len(multi) == 2 and len(images) == 2 and [m.answers for m in multi] == [[q.answer for q in qas[:3]],
                                                                                  [q.answer for q in qas[3:]]]
    tok = processor.tokenizer
    for m, first in zip(multi, single[::3]):
        assert m.input_ids[:len(first.input_ids)] == first.input_ids and m.labels[:len(first.labels)] == first.labels
        image_id = model.config.image_token_id
        assert m.input_ids.count(image_id) == first.input_ids.count(image_id) == 144  # 168 px / 14 = 12 x 12
        targets = [t for t in m.labels if t != -100]
        assert targets == sum((tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in m.answers), [])
    feats = tr.cache_features(model, processor, images)
    b = tr.collate(multi, tok.pad_token_id)
    with torch.no_grad():
        loss, exact = tr.answer_loss(model, b, feats)
        logits = model(inputs_embeds=sl.embed_with_features(model, b["input_ids"], feats[b["images"]]),
                       attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    labels = b["labels"][:, 1:]
    ref = torch.nn.functional.cross_entropy(logits[:, :-1][labels != -100], labels[labels != -100])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert exact.shape == (2,)
    with pytest.raises(ValueError, match="turns must be >= 1"):
        tr.encode_examples(processor, qas, turns=0)


def test_caption_turn_ends_each_conversation_with_the_scene_description(built):
    """``caption=True``: the questions come first, byte-identical to a run without captions; then one user turn asks
    for the objects and every token of the reading-order caption (and its EOS) is a loss target."""
    _, processor = built
    tok = processor.tokenizer
    qas = make_scene_qa(4, seed=5, per_scene=2)
    plain, images = tr.encode_examples(processor, qas, turns=2)
    captioned, images2 = tr.encode_examples(processor, qas, turns=2, caption=True)
    assert len(captioned) == len(plain) == 2 and len(images2) == len(images)
    for p, c, scene in zip(plain, captioned, (qas[0], qas[2])):
        assert c.input_ids[:len(p.input_ids)] == p.input_ids and c.labels[:len(p.labels)] == p.labels
        text = describe_scene(scene.objects)
        assert c.kinds == [*p.kinds, "caption"] and c.answers == [*p.answers, text]
        caption = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        assert [t for t in c.labels[len(p.labels):] if t != -100] == caption
        assert c.input_ids[-len(caption):] == caption
        asked = tok.decode(c.input_ids[len(p.input_ids):len(c.input_ids) - len(caption)])
        assert tr.CAPTION_PROMPT in asked and tr.INSTRUCTION not in asked and text not in asked
    assert tr.build_parser().parse_args(["--caption"]).caption is True


def test_visual_norm_penalty_measures_the_log_distance_to_the_text_scale(built, batch):
    """The penalty is the mean squared log-ratio of visual-token norms to the target: moving the target 10x away
    from the tokens' geometric-mean norm adds exactly log(10)^2; it is differentiable in the projector."""
    import math

    model, _ = built
    _, inputs = batch
    with torch.no_grad():
        feats = sl.image_features(model, inputs["pixel_values"])
        geo = float(sl.projector_of(model)(feats).norm(dim=-1).log().mean().exp())
    at = tr.visual_norm_penalty(model, feats, geo)
    off = tr.visual_norm_penalty(model, feats, 10 * geo)
    assert float(at.detach()) >= 0
    torch.testing.assert_close(off - at, torch.tensor(math.log(10) ** 2), rtol=1e-4, atol=1e-4)
    off.backward()
    assert all(p.grad is not None for p in sl.projector_of(model).parameters())
    model.zero_grad(set_to_none=True)
    rows = model.get_input_embeddings().weight.detach().norm(dim=-1)
    assert tr.median_text_norm(model) == pytest.approx(float(rows.median()))


def test_describe_scene_lists_objects_in_reading_order():
    """Row first, then column; each object's own size, colour and shape side by side; an empty scene is refused."""
    from mmaccel.data.scenes import SceneObject

    objs = (SceneObject("circle", "red", "small", (130, 20), 5, (0, 3)),
            SceneObject("square", "blue", "large", (20, 130), 9, (3, 0)),
            SceneObject("triangle", "green", "large", (20, 20), 9, (0, 0)))
    assert describe_scene(objs) == "a large green triangle, a small red circle, a large blue square."
    with pytest.raises(ValueError, match="at least one object"):
        describe_scene(())


def test_shuffle_turns_permutes_within_scenes_only():
    """Multi-turn training must not see the kinds in a fixed order (a model then answers from the turn index)."""
    qas = make_scene_qa(40, seed=2, per_scene=5)
    assert all([q.kind for q in qas[i:i + 5]] == [q.kind for q in qas[:5]] for i in range(0, 40, 5))  # the shortcut
    out = tr.shuffle_turns(qas, seed=0)
    assert [q.seed for q in out] == [q.seed for q in qas]  # scenes stay consecutive, in order
    for i in range(0, 40, 5):
        assert sorted(map(id, out[i:i + 5])) == sorted(map(id, qas[i:i + 5]))
    firsts = {out[i].kind for i in range(0, 40, 5)}
    assert len(firsts) >= 3, firsts  # turn 1 no longer always asks the same kind
    assert [q.question for q in tr.shuffle_turns(qas, seed=0)] == [q.question for q in out]
    assert [q.question for q in tr.shuffle_turns(qas, seed=1)] != [q.question for q in out]


def test_curriculum_puts_single_object_conversations_first(built):
    """``single_object_steps``: those steps' conversations come from one-object scenes and are all visited first."""
    _, processor = built
    examples, images, order = tr.training_conversations(processor, steps=5, batch_size=2, turns=3, per_scene=3,
                                                        single_object_steps=2, seed=0)
    assert len(examples) == 10 and sorted(order) == list(range(10)) and len(images) == 10
    easy, rest = [examples[i] for i in order[:4]], [examples[i] for i in order[4:]]
    assert sorted(order[:4]) == [0, 1, 2, 3]
    one = [(k, a) for e in easy for k, a in zip(e.kinds, e.answers)]
    assert all(k != "relation" for k, _ in one) and all(a in "01" for k, a in one if k == "count")
    assert any(k == "relation" for e in rest for k in e.kinds)  # 2-5 objects afterwards
    with pytest.raises(ValueError, match="single_object_steps must be in"):
        tr.train(None, steps=2, single_object_steps=2)


def test_micro_llava_recipe_and_command(monkeypatch, tmp_path):
    """``mmaccel zoo train micro-llava`` runs :func:`train` with micro-llava's recipe; the recorded command names
    only what differs from that recipe."""
    with pytest.raises(ValueError, match="unknown built LLaVA"):
        tr.train(tmp_path, name="nope")
    seen = {}
    monkeypatch.setattr(tr, "train", lambda out, **kw: seen.update(kw, out=out) or {"ok": True})
    from mmaccel.zoo.train import train_built

    assert train_built("micro-llava", tmp_path, steps=7, threads=1) == {"ok": True}
    recipe = tr.RECIPES["micro-llava"]
    assert seen["name"] == "micro-llava" and seen["language"] == "micro-lm" and seen["steps"] == 7
    assert seen["lora_rank"] == recipe["lora_rank"] > 0 and seen["single_object_steps"] == recipe["single_object_steps"]
    base = {k: recipe[k] for k in ("batch_size", "lr")}
    same = {k: v for k, v in recipe.items() if k not in ("steps", "batch_size", "lr")}
    assert tr._command(name="micro-llava", steps=1200, threads=2, device="cpu", seed=0, **base, **same) == \
        "mmaccel zoo train micro-llava --steps 1200 --batch-size 16 --lr 0.002 --threads 2"
    other = tr._command(name="micro-llava", steps=10, threads=None, device="cpu", seed=0, **base,
                        **{**same, "turns": 1})
    assert other.startswith("python -m mmaccel.zoo.train.smol_llava --name micro-llava --steps 10") and \
        other.endswith(" --turns 1")
    assert "micro-llava" in {row["name"] for row in built_mod.list_built()}


def test_an_image_token_inside_the_lm_vocabulary_is_reused(parts):
    """A tokenizer that already holds ``<image>`` inside the LM's vocabulary (as micro-lm's does) keeps its id and
    the LM is not resized; an id neither inside nor appended is one clear error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(parts[1])
    tok = AutoTokenizer.from_pretrained(parts[1], extra_special_tokens={"image_token": sl.IMAGE_TOKEN})
    appended = sl.add_image_token(lm, tok)
    rows = lm.get_input_embeddings().weight.shape[0]
    assert appended == rows - 1 == len(tok) - 1
    assert sl.add_image_token(lm, tok) == appended  # now inside the vocabulary: reused, no second row
    assert lm.get_input_embeddings().weight.shape[0] == rows
    lm.resize_token_embeddings(rows + 3)
    with pytest.raises(ValueError, match="expected <image> appended"):
        sl.add_image_token(lm, tok)


# ---------------------------------------------------------------------------------------------------------- training
def test_projector_only_step_freezes_the_rest_and_lowers_the_loss(parts):
    model, processor = sl.build_llava(*parts)
    params = tr.freeze_all_but_projector(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "multi_modal_projector" not in n}
    proj_before = [p.detach().clone() for p in params]
    examples, images = tr.encode_examples(processor, make_scene_qa(4, seed=3))
    feats = tr.cache_features(model, processor, images)
    b = tr.collate(examples, processor.tokenizer.pad_token_id)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = [tr.train_step(model, opt, b, feats)["loss"] for _ in range(20)]
    assert len(params) == 4 and sum(p.numel() for p in params) == 32 * 32 + 32 + 32 * 32 + 32
    for name, p in model.named_parameters():
        if "multi_modal_projector" in name:
            assert p.grad is not None
        else:
            assert p.grad is None and not p.requires_grad and torch.equal(p, frozen[name]), name
    assert all(not torch.equal(a, p) for a, p in zip(proj_before, params))
    assert losses[-1] < 0.8 * losses[0] and sum(losses[-5:]) < sum(losses[:5]) - 5, losses


def test_train_writes_a_projector_that_loads_back_identically(parts, built, batch, tmp_path, monkeypatch, capsys):
    pytest.importorskip("peft")
    out = tmp_path / "smol-llava"
    summary = tr.train(out, steps=4, batch_size=2, lr=3e-3, warmup=1, eval_n=4, log_every=2, vision=str(parts[0]),
                       language=str(parts[1]), progress=True, turns=5, lora_rank=8)
    assert "ETA:" in capsys.readouterr().err
    # conversations of 5 questions about one scene, LoRA adapters on the LM
    assert summary["steps_done"] == 4 and summary["examples_seen"] == 40 and summary["train_scenes"] == 8
    assert [h["step"] for h in summary["history"]] == [2, 4]
    assert summary["eta"]["per_step_s"] > 0 and summary["projector_params"] == 2 * 32 * 32 + 2 * 32
    assert summary["lora"]["rank"] == 8 and summary["lora"]["params"] > 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["eval"]["n"] == 4 and set(log["eval"]["by_kind"]) <= {"colour", "shape", "count", "relation", "size"}
    card = (out / "README.md").read_text()
    assert tr.CARD_MARKER in card and summary["command"] in card
    assert summary["command"].startswith("python -m mmaccel.zoo.train.smol_llava --steps 4 --batch-size 2 --lr 0.003")
    assert "--warmup 1 --per-scene 5 --turns 5 --lora-rank 8 --eval-n 4 --vision " in summary["command"]
    # mmaccel.load composes the same parts and the written projector: one model, whose score is the logged one
    entry = dataclasses.replace(built_mod.BUILT["smol-llava"], parts=(("vision", str(parts[0])),
                                                                      ("language", str(parts[1]))))
    monkeypatch.setitem(built_mod.BUILT, "smol-llava", entry)
    monkeypatch.setattr(built_mod, "built_path", lambda name: out)
    model, processor = mmaccel.load("smol-llava", device="cpu")
    assert isinstance(processor, type(built[1]))
    ev = tr.evaluate_scene_qa(model, processor, make_scene_qa(4, seed=0, split="test"))
    assert ev["accuracy"] == log["eval"]["accuracy"]
    again, _ = sl.build_llava(*parts, projector=out / "projector.safetensors")
    _, inputs = batch
    assert torch.equal(_logits(again, inputs), _logits(model, inputs))
    assert not torch.equal(_logits(built[0], inputs), _logits(model, inputs))  # the projector was trained
    assert load_tokenizer("smol-llava").tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id


def test_lora_training_is_stored_and_merged_at_load(parts, batch, tmp_path):
    """``lora_rank > 0``: peft adapters on the LM's linear layers learn with the projector; the file holds them and
    a load merges them into plain ``nn.Linear`` weights, giving the logits of the trained (unmerged) model."""
    pytest.importorskip("peft")
    model, processor = sl.build_llava(*parts)
    base = {n: p.detach().clone() for n, p in model.model.language_model.named_parameters()}
    params = tr.freeze_all_but_projector(model)
    lora = tr.add_lora(model, rank=4, alpha=8.0)
    assert len(lora) == 2 * len(tr.LORA_TARGETS) * model.config.text_config.num_hidden_layers
    examples, images = tr.encode_examples(processor, make_scene_qa(4, seed=3, per_scene=2), turns=2)
    feats = tr.cache_features(model, processor, images)
    b = tr.collate(examples, processor.tokenizer.pad_token_id)
    opt = torch.optim.AdamW([{"params": params}, {"params": lora}], lr=1e-2, weight_decay=0.0)
    losses = [tr.train_step(model, opt, b, feats)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0]
    _, inputs = batch
    trained = _logits(model, inputs)
    state = sl.lora_state(model.model.language_model)
    assert state["rank"] == 4 and state["scale"] == 2.0 and any(bb.abs().sum() > 0 for _, bb in state["modules"].values())
    path = sl.save_projector(model, tmp_path / "projector.safetensors", lora=state)
    again, _ = sl.build_llava(*parts, projector=path)
    assert not any("lora" in n for n, _ in again.named_parameters())
    changed = [n for n, p in again.model.language_model.named_parameters() if not torch.equal(p, base[n])]
    assert changed and all(n.endswith("proj.weight") for n in changed)
    torch.testing.assert_close(_logits(again, inputs), trained, rtol=1e-4, atol=1e-4)
    assert sl.merge_lora(again, sl.save_projector(again, tmp_path / "plain.safetensors")) == 0


def test_stacked_lora_adapters_give_the_sum_of_both_updates():
    """:func:`stack_lora`: ``scale * B @ A`` of the stack equals the two updates' sum, for different ranks and
    scales; adapters of other modules or shapes are refused."""
    gen = torch.Generator().manual_seed(0)

    def lora(rank, scale, shapes):
        return {"scale": scale, "rank": rank, "alpha": scale * rank,
                "modules": {n: (torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen))
                            for n, (o, i) in shapes.items()}}

    shapes = {"layers.0.q_proj": (8, 6), "layers.0.down_proj": (6, 10)}
    first, then = lora(2, 4.0, shapes), lora(3, 0.5, shapes)
    both = sl.stack_lora(first, then)
    assert both["rank"] == 5 and both["scale"] == 0.5 and both["alpha"] == 2.5
    for n in shapes:
        (a1, b1), (a2, b2), (a, b) = first["modules"][n], then["modules"][n], both["modules"][n]
        torch.testing.assert_close(both["scale"] * b @ a, 4.0 * b1 @ a1 + 0.5 * b2 @ a2)
    with pytest.raises(ValueError, match="different modules"):
        sl.stack_lora(first, lora(3, 0.5, {"layers.0.q_proj": (8, 6)}))
    with pytest.raises(ValueError, match="do not chain"):
        sl.stack_lora(first, lora(3, 0.5, {"layers.0.q_proj": (8, 7), "layers.0.down_proj": (6, 10)}))


def test_hf_save_pretrained_round_trip(built, batch, tmp_path):
    model, processor = built
    _, inputs = batch
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    again = LlavaForConditionalGeneration.from_pretrained(tmp_path).eval()
    proc = AutoProcessor.from_pretrained(tmp_path)
    assert proc.tokenizer.padding_side == "left"
    qas, _ = batch
    assert torch.equal(_logits(again, _inputs(proc, qas)), _logits(model, inputs))


# ------------------------------------------------------------------------------------------------------------ errors
def test_untrained_projector_is_one_clear_error_before_any_part_loads(tmp_path, monkeypatch):
    entry = dataclasses.replace(built_mod.BUILT["smol-llava"], parts=(("vision", str(tmp_path / "no-vision")),
                                                                      ("language", str(tmp_path / "no-language"))))
    monkeypatch.setitem(built_mod.BUILT, "smol-llava", entry)
    monkeypatch.setattr(built_mod, "built_path", lambda name: tmp_path)
    for call in (lambda: mmaccel.load("smol-llava"), lambda: load_tokenizer("smol-llava")):
        with pytest.raises(ModelLoadError, match="not trained yet.*run `mmaccel zoo train smol-llava`"):
            call()
    from mmaccel.cli import main

    assert main(["zoo", "train", "smol-llava", "--max-steps", "3"]) == 2
    assert main(["zoo", "train", "micro-lm", "--batch-size", "3"]) == 2


def test_a_projector_for_other_parts_is_refused(built, tmp_path):
    model, _ = built
    path = tmp_path / "projector.safetensors"
    from safetensors.torch import save_file

    save_file({"linear_1.weight": torch.zeros(8, 8)}, str(path), metadata={"format": "something else"})
    with pytest.raises(ValueError, match="not an mmaccel LLaVA projector"):
        sl.load_projector(model, path)
    sl.save_projector(model, path)
    state = dict(sl.projector_of(model).state_dict())
    state["linear_1.weight"] = torch.zeros(32, 16)
    save_file(state, str(path), metadata={"format": "mmaccel-llava-projector-v1", "recipe": sl.BuildRecipe().to_json()})
    with pytest.raises(ValueError, match="trained for other parts"):
        sl.load_projector(model, path)


@pytest.mark.parametrize("spec", ["visionzip", "prumerge"])
def test_cls_attention_methods_run_on_the_dinov2_tower(built, batch, spec):
    """VisionZip / PruMerge read the [CLS] attention of the projected tower block: DINOv2 keeps it at
    ``layer.attention`` (CLIP / SigLIP: ``layer.self_attn``). Full budget: the logits are unchanged; at 0.25 the LM
    sees a quarter of the visual tokens."""
    from mmaccel.vision_tokens import build_method

    model, _ = built
    _, inputs = batch
    with build_method(f"{spec}:keep_ratio=1.0").apply(model):
        full = model(**inputs).logits
    torch.testing.assert_close(full, model(**inputs).logits)
    method = build_method(f"{spec}:keep_ratio=0.25")
    with method.apply(model), torch.no_grad():
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
    n = int(inputs["input_ids"][0].eq(model.config.image_token_id).sum())  # 12 x 12 = 144 visual tokens a row
    assert method.telemetry["tokens_before"] == [n, n]
    assert method.telemetry["tokens_after"] == [n // 4, n // 4]


def test_bf16_autocast_training_step_matches_fp32_loss_and_updates_fp32_weights(built):
    """``autocast="bf16"``: the step's loss is the fp32 step's within bf16 rounding, the projector's weights stay
    float32 and move; an unknown value is one error that lists the choices."""
    model, processor = built
    qas = make_scene_qa(4, seed=7, per_scene=2)
    examples, images = tr.encode_examples(processor, qas, turns=2)
    feats = tr.cache_features(model, processor, images)
    batch = tr.collate(examples, processor.tokenizer.pad_token_id)
    params = tr.freeze_all_but_projector(model)
    before = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            ref, _ = tr.answer_loss(model, batch, feats)
        opt = torch.optim.SGD(params, lr=1e-2)
        m = tr.train_step(model, opt, batch, feats, autocast="bf16")
        assert abs(m["loss"] - float(ref)) < 0.05 * float(ref)
        assert all(p.dtype == torch.float32 for p in params)
        assert any(not torch.equal(p, q) for p, q in zip(params, before))
    finally:
        with torch.no_grad():
            for p, q in zip(params, before):
                p.copy_(q)
        model.requires_grad_(False)
    with pytest.raises(ValueError, match="unknown autocast 'fp16'.*none.*bf16"):
        tr.autocast_context("fp16")


# ------------------------------------------------------------------------------------------------------------ clips
def test_clip_conversations_compose_base_frames_and_a_rendered_needle(built):
    """A video-NIAH training conversation: F frames of a base clip at 9 pooled tokens each, two turns (the needle's
    number and colour, the answers the only targets), and features that are the base clip's rows with the needle
    frame's row swapped in -- the rows of encoding that composed clip."""
    from PIL import Image

    from mmaccel.zoo.train import clips as ct

    model, processor = built
    examples, bases, needles = ct.clip_conversations(processor, 6, bases=2, seed=0)
    assert len(examples) == len(needles) == 6 and len(bases) == 2
    tok = processor.tokenizer
    image_id = model.config.image_token_id
    for e in examples:
        assert len(e.frames) in ct.CLIP_FRAMES and e.frames == sorted(e.frames) and 0 <= e.needle < len(e.frames)
        assert e.input_ids.count(image_id) == len(e.frames) * ct.TOKENS_PER_FRAME
        targets = [t for t, lab in zip(e.input_ids, e.labels) if lab != -100]
        assert tok.decode(targets).replace(tok.eos_token, " ").split() == e.answers
        assert sorted(e.kinds) == ["colour", "number"] and e.answers[e.kinds.index("number")].isdigit()
    e = examples[0]
    clip = dataclasses.replace(bases[e.base], needle_frame=e.frames[e.needle], number=e.answers[e.kinds.index("number")],
                               number_colour=e.answers[e.kinds.index("colour")])
    assert (needles[0] == clip.frame(e.frames[e.needle])).all()
    base = bases[e.base]  # its own needle removed; at 256 frames an index appears twice, the needle only once
    frames = [Image.fromarray(clip.frame(t) if i == e.needle else base.frame(t)) for i, t in enumerate(e.frames)]
    base_feats = [tr.cache_features(model, processor, [Image.fromarray(f) for f in b.frames()]) for b in bases]
    needle_feats = tr.cache_features(model, processor, [Image.fromarray(n) for n in needles[:1]])
    composed = ct.features_of(e, base_feats, needle_feats)
    assert torch.allclose(composed, tr.cache_features(model, processor, frames), atol=1e-5)
    batches = ct.clip_batches(examples, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len({len(examples[i].frames) for i in b}) == 1 for b in batches)


def test_train_with_clip_steps_interleaves_them(parts, tmp_path):
    summary = tr.train(tmp_path / "m", steps=2, batch_size=2, lr=3e-3, warmup=1, eval_n=0, log_every=1,
                       vision=str(parts[0]), language=str(parts[1]), progress=False, clip_every=1, clip_bases=1)
    assert summary["steps_done"] == 4 and summary["scene_steps_done"] == 2 and summary["clip_steps_done"] == 2
    assert summary["clip_conversations_seen"] >= 2 and summary["examples_seen"] == 4
    assert all(h["loss"] > 0 for h in summary["history"])
    assert "--clip-every 1 --clip-bases 1" in summary["command"]


def test_clip_only_run_from_a_trained_projector_with_a_reading_phase(parts, tmp_path):
    """``steps=0, clip_steps=N``: a run on clips only (LLaVA's stage 2 from a stage-1 projector); the first
    ``clip_short_steps`` batches hold 1- and 4-frame clips only. It starts from ``init_projector``'s weights and
    recipe; a file holding LoRA adapters is refused, as are bad step counts."""
    from safetensors.torch import load_file

    from mmaccel.zoo.train import clips as ct

    first = tr.train(tmp_path / "a", steps=1, batch_size=2, lr=3e-3, warmup=1, eval_n=0, vision=str(parts[0]),
                     language=str(parts[1]), progress=False)
    init = tmp_path / "a" / "projector.safetensors"
    summary = tr.train(tmp_path / "b", steps=0, batch_size=2, lr=3e-3, warmup=1, eval_n=0, log_every=1,
                       vision=str(parts[0]), language=str(parts[1]), progress=False, clip_steps=3, clip_short_steps=2,
                       clip_bases=1, init_projector=init)
    assert summary["scene_steps_done"] == 0 and summary["clip_steps_done"] == 3 and summary["steps_done"] == 3
    assert summary["init_projector"] == str(init) and first["recipe"] == summary["recipe"]
    assert f"--clip-steps 3 --clip-short-steps 2 --init-projector {init}" in summary["command"]
    assert any(not torch.equal(a, b) for a, b in zip(load_file(init).values(),
                                                     load_file(tmp_path / "b" / "projector.safetensors").values()))
    model, processor = sl.build_llava(*parts)
    data = tr._clip_data(model, processor, 4, 1, 0, False, short=2)
    lengths = [{len(data["examples"][i].frames) for i in b} for b in data["batches"]]
    assert len(lengths) == 4 and all(len(s) == 1 for s in lengths)
    assert all(s <= set(ct.SHORT_FRAMES) for s in lengths[:2])
    for e in data["examples"]:  # every needle row is its own rendered frame's
        assert 0 <= e.needle_row < data["needles"].shape[0]
    pytest.importorskip("peft")
    lora = tr.train(tmp_path / "c", steps=1, batch_size=2, lr=3e-3, warmup=1, eval_n=0, vision=str(parts[0]),
                    language=str(parts[1]), progress=False, lora_rank=2)
    assert lora["lora"]["rank"] == 2 and lora["stored_lora_rank"] == 2
    # a run from a file with adapters continues it: they are merged first, and stored stacked with the new ones
    init = tmp_path / "c" / "projector.safetensors"
    more = tr.train(tmp_path / "d", steps=2, batch_size=2, lr=3e-3, lora_lr=3e-2, warmup=1, eval_n=0,
                    vision=str(parts[0]), language=str(parts[1]), progress=False, lora_rank=3, init_projector=init)
    assert more["init_lora_rank"] == 2 and more["stored_lora_rank"] == 5
    old, new = sl.read_lora(init), sl.read_lora(tmp_path / "d" / "projector.safetensors")
    assert new["rank"] == 5 and set(new["modules"]) == set(old["modules"])
    for name, (a, b) in new["modules"].items():
        assert torch.equal(a[:2], old["modules"][name][0])
        torch.testing.assert_close(new["scale"] * b[:, :2], old["scale"] * old["modules"][name][1])
    assert any(b[:, 2:].abs().sum() > 0 for _, b in new["modules"].values())  # the new adapters learnt
    projector_only = tr.train(tmp_path / "e", steps=1, batch_size=2, lr=3e-3, warmup=1, eval_n=0,
                              vision=str(parts[0]), language=str(parts[1]), progress=False, init_projector=init)
    assert projector_only["stored_lora_rank"] == 2  # the merged adapters stay in the file a load rebuilds from
    with pytest.raises(ValueError, match="clip_short_steps"):
        tr.train(tmp_path / "e", steps=0, vision=str(parts[0]), language=str(parts[1]), progress=False)
    with pytest.raises(ValueError, match="clip_short_steps"):
        tr.train(tmp_path / "e", steps=1, clip_steps=1, clip_short_steps=2, vision=str(parts[0]),
                 language=str(parts[1]), progress=False)


def test_question_first_puts_the_image_after_the_question_in_training_and_at_load(parts, tmp_path):
    """``question_first``: the recipe records it, so training, its evaluation and a later load all write the
    question before the image, also for chats written image-first (HF's usual order) and for several images; a
    stage 2 from an image-first projector keeps its other recipe fields and takes the new order."""
    first = tr.train(tmp_path / "a", steps=1, batch_size=2, lr=3e-3, warmup=1, eval_n=0, vision=str(parts[0]),
                     language=str(parts[1]), progress=False)
    init = tmp_path / "a" / "projector.safetensors"
    summary = tr.train(tmp_path / "b", steps=1, batch_size=2, lr=3e-3, warmup=1, eval_n=2, vision=str(parts[0]),
                       language=str(parts[1]), progress=False, question_first=True, init_projector=init)
    assert not first["recipe"]["question_first"] and summary["recipe"]["question_first"]
    assert {k: v for k, v in summary["recipe"].items() if k != "question_first"} == \
        {k: v for k, v in first["recipe"].items() if k != "question_first"}
    assert "--question-first" in summary["command"]
    _, processor = sl.build_llava(*parts, projector=tmp_path / "b" / "projector.safetensors")
    text = processor.apply_chat_template(tr.messages("What color is the square?"), add_generation_prompt=True,
                                         tokenize=False)
    assert text.index("What color is the square?") < text.index(sl.IMAGE_TOKEN)
    assert text.endswith(f"phrase.\n{sl.IMAGE_TOKEN}\n<|im_end|>\n<|im_start|>assistant\n")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Q?"}]}]
    assert processor.apply_chat_template(chat, tokenize=False).startswith(
        f"<|im_start|>user\nQ?\n{sl.IMAGE_TOKEN}\n{sl.IMAGE_TOKEN}\n<|im_end|>")
    qas = make_scene_qa(5, seed=0, split="train", per_scene=5)
    examples, _ = tr.encode_examples(processor, qas[:1])
    ids = examples[0].input_ids
    first_image = ids.index(processor.tokenizer.convert_tokens_to_ids(sl.IMAGE_TOKEN))
    question = processor.tokenizer.encode(qas[0].question, add_special_tokens=False)
    assert any(ids[i:i + len(question)] == question for i in range(first_image))  # the question precedes the image
    _, default = sl.build_llava(*parts, projector=init)
    assert default.chat_template == sl.CHAT_TEMPLATE and processor.chat_template == sl.CHAT_TEMPLATE_QUESTION_FIRST
