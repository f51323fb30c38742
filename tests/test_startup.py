"""Start-up: a run says where its seconds before the first step went, and a preset model built on ``meta`` is
initialised where it runs with the values a fresh model has."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def test_json_gives_each_start_up_phase():
    proc = subprocess.run([sys.executable, "-m", "longpack.cli", "train", "--workload", "tiny-longtail", "--model",
                           "tiny-llama", "--nproc", "1", "--steps", "2", "--global-batch", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    startup = [x["startup"] for x in lines if "startup" in x]
    assert len(startup) == 1 and list(lines[-3]) == ["startup"]  # after step 0, before step 1
    s = startup[0]
    assert list(s) == ["imports", "process_group", "data", "plan", "model", "first_step", "total"]
    assert all(v >= 0 for v in s.values()) and s["imports"] > 0.5  # torch and transformers were imported
    assert abs(sum(v for k, v in s.items() if k != "total") - s["total"]) < 0.01


def test_a_preset_built_on_meta_is_initialised_like_a_fresh_model():
    from longpack.model import get_model
    from longpack.runtime.run.hf_model import build

    spec = get_model("tiny-llama")
    model = build(spec, 0, torch.float32, torch.device("cpu"), meta=True)
    fresh = build(spec, 0, torch.float32, torch.device("cpu"))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert p.device.type == "cpu" and p.shape == q.shape and torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # the same initializer: normal with the config's initializer_range (0.02)
            assert abs(float(p.detach().std()) - 0.02) < 0.002 and abs(float(p.detach().mean())) < 0.002, name
    for (name, b), c in zip(model.named_buffers(), fresh.buffers(), strict=True):
        assert torch.equal(b, c), name  # RoPE's inverse frequencies, computed again after to_empty
