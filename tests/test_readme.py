"""The README's quick-start snippet and docs/notebooks.md's cells run as written."""

import logging
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_snippet_runs(capsys):
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {"__name__": "readme"}
    exec(compile(snippet, "README.md", "exec"), scope)
    step, loss = capsys.readouterr().out.split()
    assert int(step) == 200 and float(loss) < 0.3


def test_nnx_snippet_trains_an_nnx_module():
    section = README.read_text().split("## Flax NNX, the NNX way", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from jaxloop import step, train_loop

    scope = {"__name__": "readme", "step": step, "optax": optax, "nnx": nnx}
    exec(compile(snippet, "README.md", "exec"), scope)
    x = np.random.default_rng(0).normal(size=(512, 16)).astype(np.float32)
    batches = [{"x": x[i:i + 64], "y": (x[i:i + 64, 0] > 0).astype(np.int32)}
               for i in range(0, 512, 64)]
    train_step = scope["NnxStep"](jax.random.key(0), nnx.Linear(16, 2, rngs=nnx.Rngs(0)),
                                  optimizer=optax.adam(1e-2), train=True)
    state, _ = train_loop.TrainLoop(train_step)(
        train_step.initialize_model([1, 16]), iter(batches * 25), num_steps=200)
    logits = state.apply_fn({"params": state.params}, x)
    assert int(state.step) == 200 and np.mean(logits.argmax(-1) == (x[:, 0] > 0)) > 0.95


def test_readme_keeps_exactly_two_setup_commands():
    setup = README.read_text().split("## Set-up", 1)[1].split("##", 1)[0]
    commands = re.search(r"```bash\n(.*?)```", setup, re.S).group(1).strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == [
        "bash scripts/main.sh", "bash scripts/test.sh"]


# --- docs/notebooks.md: the cells a notebook user copies --------------------------------------

NOTEBOOKS_MD = README.parent / "docs" / "notebooks.md"

# What the page's cells take as given (its notebooks define them on the digits): a small
# classifier and step, the digits as an endless, resumable train dataset and eval batches.
NOTEBOOKS_MD_PREAMBLE = """
import pathlib, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np, optax
from sklearn.datasets import load_digits
from models import ClassifierStep as DigitsStep, LinenMLP as CNN
from jaxloop import actions, data, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint

digits = load_digits()
images = (digits.images / 16).astype(np.float32)[..., None]
labels = digits.target.astype(np.int32)
train_ds = data.GlobalBatchDataset({{"x": images[:1400], "y": labels[:1400]}}, 32, seed=0)
eval_ds = [{{"x": images[i:i + 100], "y": labels[i:i + 100]}} for i in range(1400, 1700, 100)]
workdir = pathlib.Path({workdir!r})
"""


def notebook_snippets(heading: str) -> list[str]:
    """The python code blocks of the docs/notebooks.md section `heading`, as written."""
    section = NOTEBOOKS_MD.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def notebook_preamble(workdir) -> str:
    return NOTEBOOKS_MD_PREAMBLE.format(tests=str(Path(__file__).parent), workdir=str(workdir))


def run_cells(scope: dict, *cells: str) -> dict:
    for cell in cells:
        exec(compile(cell, "docs/notebooks.md", "exec"), scope)
    return scope


def test_notebooks_md_continue_cell_runs_after_a_finished_run_and_again(tmp_path, caplog):
    build, train = notebook_snippets("Building loops cell by cell")[:2]
    cont, catch = notebook_snippets("Interrupting and continuing")
    scope = run_cells({"__name__": "notebook"}, notebook_preamble(tmp_path), build, train)
    assert int(scope["state"].step) == 500 and scope["outer"].stopped_state is None
    run_cells(scope, cont)
    assert int(scope["state"].step) == 1000
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        run_cells(scope, cont)  # the same cell again: nothing to train, the state is kept
    assert "Nothing to train" in caplog.text
    assert scope["state"] is scope["outer"].state and int(scope["state"].step) == 1000
    run_cells(scope, catch)
    assert int(scope["state"].step) == 1500
    assert scope["outer"].history["eval/loss"].steps[-1] == 1500


def test_notebooks_md_resume_cell_run_again_after_a_restart_resumes(tmp_path, caplog):
    [build, _] = notebook_snippets("Building loops cell by cell")[:2]
    [resume] = notebook_snippets("Resuming after a kernel restart")
    first = run_cells({"__name__": "notebook"}, notebook_preamble(tmp_path), build, resume)
    assert int(first["state"].step) == 1000
    # A restart: a new scope runs the same cells.
    with caplog.at_level(logging.INFO, logger="jaxloop"):
        second = run_cells({"__name__": "notebook"}, notebook_preamble(tmp_path), build, resume)
    assert f"Resumed from step 1000 of {tmp_path / 'checkpoints'}" in caplog.text
    assert int(second["state"].step) == 1000
    assert second["outer"].history["eval/loss"] == first["outer"].history["eval/loss"]


def test_readme_is_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= 200


def test_no_docstring_or_comment_quotes_a_timing_of_this_machine():
    """Figures live in benchmarks/RESULTS.txt: the package's text says what and why."""
    timing = re.compile(r"\d\s?(?:µs|us|ms)\b|µs on|us on this|on this (?:machine|CPU)")
    found = [f"{path}:{n}: {line.strip()}"
             for path in sorted((README.parent / "jaxloop").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if timing.search(line)]
    assert not found, "\n".join(found)
