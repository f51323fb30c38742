"""Pipeline parallelism for real (runtime/kernel/pipeline.py): the decoder split into stages on gloo processes, each
step's micro-batches in the state-aware 1F1B order, chains with their K/V store per stage — equal to
single-process unpacked training of the same samples in float64."""

import pytest

torch = pytest.importorskip("torch")

import forked  # noqa: E402  (tests/forked.py: commands as forked processes)
import pool  # noqa: E402  (tests/pool.py: warm worker processes)
from dist_workers import pipeline_worker, step_reference  # noqa: E402

from longpack.plan import Plan  # noqa: E402
from longpack.runtime.dist import free_port  # noqa: E402

RTOL = 1e-6  # float64: only the order of additions differs


def _run(tmp_path, pp, cp=1, k=1, chunk=32, layers=4):
    out = str(tmp_path / "out.pt")
    world = pp * cp
    pool.spawn(pipeline_worker, args=(world, free_port(), out, pp, cp, k, chunk, layers),
                                nprocs=world)
    got = torch.load(out, weights_only=False)
    ref = step_reference(Plan.from_json(got["plan"]), 0, layers=layers)
    assert got["loss"] > 0
    for name, g in ref.items():
        err = float((got["grads"][name] - g).norm() / g.norm())
        assert err <= RTOL, (name, err)
    return got


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("k", [1, None], ids=["k1", "kall"])
def test_chunk_pipeline_parity(tmp_path, pp, k):
    """PP 2 and 4 on a 4-layer model: a 3-chunk chain (K = 1: two recomputed; K = all) between whole samples."""
    got = _run(tmp_path, pp, k=k)
    kinds = {kind for kind, *_ in got["ops"]}
    assert kinds == ({"F", "R", "B"} if k == 1 else {"F", "B"})


def test_chunk_context_parallel_pipeline_parity_pp2_cp2(tmp_path):
    """PP 2 x CP 2 on 4 processes: the chain sharded over each stage's CP pair."""
    _run(tmp_path, 2, cp=2)


def _train(*flags: str, expect: int = 0):
    import json

    if expect == 0:
        proc = pool.cli(["train", "--json", *flags], timeout=400)
    else:  # the launcher's own check, before it spawns anything
        proc = forked.run(["train", "--json", *flags], timeout=400)  # tests/forked.py: a real process
    assert proc.returncode == expect, proc.stderr
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"step"')], proc.stderr


def _same_model(a, b, atol: float = 1e-8) -> None:
    from transformers import AutoModelForCausalLM

    one = AutoModelForCausalLM.from_pretrained(a).state_dict()
    two = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert one.keys() == two.keys()
    for name, w in one.items():
        assert float((two[name] - w).abs().max()) <= atol, name


def test_chunk_pipeline_fsdp_parity_train_cli_pp2_same_loss_and_model_as_one_process(tmp_path):
    """The issue's command: ChunkFlow chains through 2 pipeline stages train 3 steps with the losses of one process
    running the same plan (float64, loss ≤ 1e-6 relative, weights ≤ 1e-8), log measured and simulated bubbles,
    and write the same Hugging Face checkpoint; so does PP 2 x DP 2 on 4 processes with FSDP2 within each stage
    (its own plan: weights ≤ 1e-7)."""
    chunk = ["--model", "tiny", "--planner", "chunkflow", "--opt", "chunk_size=256", "--opt", "k=1", "--steps", "3",
             "--dtype", "float64", "--max-grad-norm", "0.3"]
    plain, _ = _train(*chunk, "--nproc", "1", "--output-dir", str(tmp_path / "one"))
    piped, _ = _train(*chunk, "--pp", "2", "--nproc", "2", "--output-dir", str(tmp_path / "pp"))
    assert len(piped) == len(plain) == 3
    assert piped[0]["planner_wait_seconds"] > 0 and all(s["planner_wait_seconds"] >= 0 for s in piped[1:])
    assert max(s["grad_norm"] for s in plain) > 0.3  # --max-grad-norm 0.3 clips: the stages sum their norms
    for a, b in zip(piped, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["targets"] == b["targets"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        pipe = a["pipeline"]
        assert pipe["stage"] == [0, 1] and all(x > 0 for x in pipe["busy_seconds"])
        assert 0 <= pipe["measured_bubble"][0] < 1 and 0 <= pipe["simulated_bubble"][0] < 1
    _same_model(tmp_path / "one", tmp_path / "pp")
    sharded, _ = _train(*chunk, "--pp", "2", "--nproc", "4", "--output-dir", str(tmp_path / "fsdp"))
    assert [s["pipeline"]["stage"] for s in sharded] == [[0, 0, 1, 1]] * 3
    for a, b in zip(sharded, plain, strict=True):  # another plan (DP 2), the same exact steps
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)  # DTensor shards, then stages
    # another plan sums the same gradients in another order, and AdamW divides each by its root mean square: an
    # embedding row whose gradient nearly cancels moves a little apart (3.5e-8 measured, against 1e-3 steps)
    _same_model(tmp_path / "one", tmp_path / "fsdp", atol=1e-7)


@pytest.mark.parametrize(("flags", "says"), [
    (["--pp", "3", "--nproc", "4"], "--pp 3 must divide the number of processes (4)"),
    (["--pp", "3", "--nproc", "3", "--no-fsdp"], "--pp 3: must divide the model's 4 layers"),
])
def test_pipeline_bad_layouts_refused_in_one_line(flags, says):
    _, err = _train("--steps", "1", *flags, expect=2)
    assert says in err and len(err.strip().splitlines()) == 1


def test_pipeline_parity_tied_embeddings_pp2_cli(tmp_path):
    """A checkpoint whose LM head is tied to its embeddings (Qwen2.5-0.5B, Llama 3.2 style): the first stage holds
    the embeddings, the last the head, and their gradients are summed; 2 stages write the checkpoint one process
    writes (float64, weights ≤ 1e-8)."""
    from dataclasses import replace

    from longpack.model import get_model
    from longpack.runtime.run.hf_model import build, save

    model = build(replace(get_model("tiny-llama"), tied_embeddings=True), 0, torch.float64)
    assert model.config.tie_word_embeddings
    save(model, model.state_dict(), tmp_path / "tied")
    flags = ["--model-path", str(tmp_path / "tied"), "--steps", "2", "--dtype", "float64", "--planner", "chunkflow",
             "--opt", "chunk_size=256", "--opt", "k=1"]
    _train(*flags, "--nproc", "1", "--output-dir", str(tmp_path / "one"))
    _train(*flags, "--nproc", "2", "--pp", "2", "--output-dir", str(tmp_path / "pp"))
    _same_model(tmp_path / "one", tmp_path / "pp")


def test_pipeline_fsdp_parity_checkpoint_resume_at_the_next_step(tmp_path):
    """PP 2 x DP 2 (FSDP2 within the stages): a run checkpointed after 2 steps and resumed for the third writes
    the model an uninterrupted 3-step run on one process writes (float64, weights ≤ 1e-7); stages keep disjoint
    checkpoint keys."""
    flags = ["--model", "tiny", "--planner", "chunkflow", "--opt", "chunk_size=256", "--opt", "k=1", "--dtype",
             "float64", "--pp", "2", "--nproc", "4", "--checkpoint-dir", str(tmp_path / "ck")]
    first, _ = _train(*flags, "--steps", "2", "--checkpoint-every", "2")
    rest, _ = _train(*flags, "--steps", "3", "--resume", "--output-dir", str(tmp_path / "resumed"))
    assert [s["step"] for s in first] == [0, 1] and [s["step"] for s in rest] == [2]
    whole, _ = _train("--model", "tiny", "--planner", "chunkflow", "--opt", "chunk_size=256", "--opt", "k=1",
                      "--dtype", "float64", "--nproc", "1", "--steps", "3", "--output-dir", str(tmp_path / "whole"))
    assert rest[0]["loss"] == pytest.approx(whole[2]["loss"], rel=1e-6)
    _same_model(tmp_path / "whole", tmp_path / "resumed", atol=1e-7)  # DP 2 against DP 1: see the test above
