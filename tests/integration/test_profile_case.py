"""``benchmarks/profile_case.py`` side by side, on the CPU: its options, its kernel table
from a real ``torch.profiler`` run of a tiny model, and its markdown summary."""

from __future__ import annotations

import tempfile

import pytest
import torch

from _helpers import benchmark_scripts

MODEL_FILE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 40)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x))) * 0.5


def make():
    torch.manual_seed(0)
    return Block(), torch.randn(1, 37, 24)
"""


@pytest.fixture(scope="module")
def profile_case():
    with benchmark_scripts("profile_case") as module:
        yield module


def test_options_default_to_autofuser_beside_reduce_overhead_and_refuse_bad_ones(profile_case, capsys):
    args = profile_case.parse_args(["--zoo", "unet"])
    assert args.side_by_side and args.systems == ["autofuser", "reduce-overhead"] and args.top == 15
    args = profile_case.parse_args(["--factory", "m.py:make", "--systems", "eager, autofuser,max-autotune"])
    assert args.systems == ["eager", "autofuser", "max-autotune"] and args.zoo is None
    args = profile_case.parse_args(["--zoo", "galerkin", "--train", "--systems", "autofuser,autofuser-fused"])
    assert args.systems == ["autofuser", "autofuser-fused"]
    assert not profile_case.parse_args(["--form", "galerkin"]).side_by_side  # the single-case path
    for argv, says in (
        (["--zoo", "nonesuch"], "not a zoo model"),
        (["--zoo", "unet", "--factory", "m.py:make"], "give one"),
        (["--factory", "m.py"], "not MODULE:FACTORY"),
        (["--zoo", "unet", "--systems", "autofuser,fastest"], "fastest unknown"),
        (["--zoo", "unet", "--systems", "autofuser,autofuser"], "once"),
        (["--zoo", "unet", "--top", "0"], "--top must be at least 1"),
        (["--zoo", "unet", "--calls", "0"], "--calls must be at least 1"),
    ):
        with pytest.raises(SystemExit):
            profile_case.parse_args(argv)
        assert says in capsys.readouterr().err, argv


def test_summary_lists_each_systems_top_kernels_per_forward(profile_case):
    row = profile_case.KernelRow
    long_name = "triton_per_fused_native_layer_norm_" + "x" * 200
    profiles = {
        "autofuser": [row("fused_ln_linear_gelu", 1.0, 0.30), row("copy|kernel", 2.0, 0.10)],
        "reduce-overhead": [row(long_name, 1.0, 0.25), row("sm90_gemm", 1.0, 0.20), row("triton_poi", 3.0, 0.05)],
    }
    text = profile_case.render_summary(profiles, top=2, title="unet (airfoil)", where="cuda (H200)", calls=20)
    lines = text.splitlines()
    assert lines[0] == "# Kernels per forward: unet (airfoil)"
    assert "| AutoFuser | 3 | 2 | 0.400 |" in lines
    assert "| torch.compile reduce-overhead | 5 | 3 | 0.500 |" in lines
    assert "## AutoFuser: top 2 of 2" in lines and "## torch.compile reduce-overhead: top 2 of 3" in lines
    assert "| `fused_ln_linear_gelu` | 1 | 0.300 | 75% |" in lines
    assert "| `copy\\|kernel` | 2 | 0.100 | 25% |" in lines  # a | in a name does not split the cell
    cut = long_name[: profile_case.NAME_WIDTH - 3] + "..."
    assert f"| `{cut}` | 1 | 0.250 | 50% |" in lines
    assert "| `sm90_gemm` | 1 | 0.200 | 40% |" in lines
    assert "triton_poi" not in text  # past the top 2
    assert "GPU kernels" in lines[2]


def test_side_by_side_profiles_a_tiny_model_on_the_cpu(profile_case, tmp_path, monkeypatch):
    """A real torch.profiler run of eager and AutoFuser (under the interpreter) on a
    MODULE:FACTORY model: eager's ops are the model's own, counted once per forward. The
    cache folder it makes for a cold compile is removed when it is done."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    (tmp_path / "tiny_block.py").write_text(MODEL_FILE)
    out = tmp_path / "profile.md"
    factory = f"{tmp_path / 'tiny_block.py'}:make"
    argv = ["--factory", factory, "--device", "cpu", "--systems", "eager,autofuser", "--calls", "3"]
    assert profile_case.main([*argv, "--warmup", "1", "--top", "4", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(f"# Kernels per forward: {factory} (fp32)")
    assert "CPU ops (self time" in text
    assert "## eager: top 4 of" in text and "## AutoFuser: top 4 of" in text
    profiles, _, where = profile_case.profile_systems(profile_case.parse_args([*argv, "--warmup", "0"]))
    assert where == "cpu"
    eager = {row.name: row for row in profiles["eager"]}
    for op in ("aten::layer_norm", "aten::linear", "aten::gelu"):
        assert eager[op].launches == 1 and eager[op].ms >= 0, op
    assert all(earlier.ms >= later.ms for earlier, later in zip(profiles["eager"], profiles["eager"][1:]))
    assert profiles["autofuser"] and "aten::gelu" not in {row.name for row in profiles["autofuser"]}
    assert list(temp.glob("autofuser-profile-*")) == []
    torch._dynamo.reset()


def test_train_profiles_training_steps_with_their_backward(profile_case, tmp_path):
    """--train profiles whole training steps: eager's rows hold each op's backward too, once
    per step, and the step leaves the model's gradients set."""
    (tmp_path / "tiny_block.py").write_text(MODEL_FILE)
    factory = f"{tmp_path / 'tiny_block.py'}:make"
    args = profile_case.parse_args(
        ["--factory", factory, "--device", "cpu", "--systems", "eager", "--calls", "2", "--warmup", "0", "--train"]
    )
    profiles, title, _ = profile_case.profile_systems(args)
    assert title.endswith("training steps")
    eager = {row.name: row for row in profiles["eager"]}
    for op in ("aten::gelu", "aten::gelu_backward", "aten::native_layer_norm_backward"):
        assert eager[op].launches == 1, op
    text = profile_case.render_summary(profiles, top=3, title=title, where="cpu", calls=2, call="training step")
    assert text.startswith("# Kernels per training step:")


def test_memory_sites_group_live_blocks_by_the_line_outside_torch_that_made_them(profile_case):
    """``live_sites`` reads an allocator snapshot: only allocated blocks of the device asked
    for and not there before count, each named by its innermost frame outside torch (with
    its caller where that is AutoFuser's runtime), those in a CUDA graph's pool marked,
    largest first."""
    mb = 2**20

    def frames(*where):
        return [{"filename": f, "line": line, "name": name} for f, line, name in where]

    ours = ("/x/autofuser_core/cudagraphs.py", 201, "__init__")
    launch = ("/x/autofuser_core/launch.py", 120, "launch")
    graph_code = ("<eval_with_key>.3", 9, "forward")
    theirs = ("/y/site-packages/torch/nn/functional.py", 10, "linear")
    model = ("/m/model.py", 7, "forward")

    def block(size, state="active_allocated", where=(), address=0):
        return {"size": size * mb, "state": state, "frames": frames(*where), "address": address}

    segments = [
        {
            "device": 0,
            "segment_pool_id": (0, 0),
            "blocks": [
                block(3, where=(theirs, model), address=1),
                block(5, "inactive", (model,), address=2),
                block(1, where=(model,), address=3),
                block(4, where=(launch, ours, graph_code), address=4),
                block(9, where=(model,), address=5),  # there before
            ],
        },
        {
            "device": 0,
            "segment_pool_id": (1, 3),
            "blocks": [
                block(7, where=(theirs, ours), address=6),
                block(2, "active_pending_free", (ours,), address=7),
                block(1, address=8),
            ],
        },
        {"device": 1, "segment_pool_id": (0, 0), "blocks": [block(50, where=(model,), address=9)]},
    ]
    sites = profile_case.live_sites({"segments": segments}, device=0, before=frozenset({5}))
    assert [(s.where, s.mb, s.blocks) for s in sites] == [
        ("cudagraphs.py:201 in __init__ [graph pool]", 7.0, 1),
        ("launch.py:120 in launch <- <eval_with_key>.3:9 in forward", 4.0, 1),
        ("model.py:7 in forward", 4.0, 2),
        ("(no stack recorded) [graph pool]", 1.0, 1),
    ]
    text = profile_case.render_memory({"autofuser": (12.5, sites)}, top=2)
    assert "| AutoFuser | 12.5 |" in text
    assert "| 7.0 | 1 |" in text and "model.py" not in text


def test_memory_on_a_cpu_says_there_is_no_allocator_history(profile_case, tmp_path, capsys):
    (tmp_path / "tiny_block.py").write_text(MODEL_FILE)
    argv = ["--factory", f"{tmp_path / 'tiny_block.py'}:make", "--device", "cpu", "--systems", "eager"]
    assert profile_case.main([*argv, "--calls", "1", "--warmup", "0", "--memory"]) == 0
    assert "--memory: no CUDA device" in capsys.readouterr().out
