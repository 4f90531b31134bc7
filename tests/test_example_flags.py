"""The examples' opt-in feature flags, run as a user would (real subprocesses)."""

import json
import re
import subprocess
import sys

import pytest
from test_digits import optimized_env

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

FINAL = re.compile(r"^final step=(\d+) eval_accuracy=([0-9.]+) ")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_digits_with_accumulation_ema_guard_telemetry_and_cache(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.examples.digits", "--workdir", str(tmp_path / "w"),
         "--train-steps", "200", "--train-loop-steps", "100", "--microbatches", "2",
         "--ema-decay", "0.9", "--nonfinite", "skip", "--telemetry",
         "--compilation-cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600, env=optimized_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = FINAL.match(proc.stdout.strip().splitlines()[-1])
    assert match and int(match.group(1)) == 200 and float(match.group(2)) > 0.9
    record = json.loads((tmp_path / "w" / "run.json").read_text())
    assert record["config"]["microbatches"] == 2 and record["mesh"]["shape"] == {"data": 8}
    acc = eam.EventAccumulator(str(tmp_path / "w" / "train"), size_guidance={eam.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"telemetry/grad_norm", "telemetry/update_norm", "nonfinite/skipped"} <= tags
    assert [e.value for e in acc.Scalars("nonfinite/skipped")] == [0.0] * 200
    assert any((tmp_path / "cache").iterdir())


def test_example_flags_are_checked(capsys):
    from jaxloop.examples import digits, transformer

    for module in (digits, transformer):
        with pytest.raises(SystemExit):
            module.parse_args(["--batch-size", "64", "--microbatches", "3"])
        assert "multiple of --microbatches" in capsys.readouterr().err
    args = digits.parse_args(["--nonfinite", "raise", "--compilation-cache", "/tmp/c"])
    assert args.nonfinite == "raise" and args.compilation_cache == "/tmp/c"
    assert args.microbatches == 1 and args.ema_decay is None and not args.telemetry


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_features_under_two_processes_match_one_process(tmp_path):
    # The guard's decision and the accumulated gradients are global (SPMD) values, so two
    # processes of 4 devices train like one process of 8.
    from test_multiprocess import run_digits

    flags = ("--train-steps", "40", "--train-loop-steps", "20", "--batch-size", "64",
             "--microbatches", "2", "--ema-decay", "0.9", "--nonfinite", "skip", "--telemetry")
    two = run_digits(tmp_path / "two", *flags, optimized=True)  # runs more than it compiles
    one = run_digits(tmp_path / "one", *flags, processes=1, optimized=True)
    assert one.step == two.step == 40
    assert abs(one.loss - two.loss) < 1e-4, (one, two)
    record = json.loads((tmp_path / "two" / "run.json").read_text())
    assert record["devices"]["process_count"] == 2 and record["devices"]["count"] == 8


def test_bad_config_overrides_name_the_field(capsys):
    from jaxloop.examples import digits, transformer
    from jaxloop.launch import config as config_lib

    for module in (digits, transformer):
        with pytest.raises(SystemExit):
            module.parse_args(["--train-steps", "many"])
        assert "argument --train-steps: invalid int value: 'many'" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            module.parse_args(["--learnig-rate", "0.1"])
        err = capsys.readouterr().err
        assert "--learnig-rate (did you mean --learning-rate?)" in err
        with pytest.raises(SystemExit):
            module.parse_args(["--nonfinite", "sometimes"])
        assert "argument --nonfinite: invalid choice: 'sometimes'" in capsys.readouterr().err
    config = transformer.parse_args(["--partitioner", "spmd", "--telemetry", "--d-model", "32"])
    assert isinstance(config, transformer.Config)
    assert (config.partitioner, config.telemetry, config.d_model) == ("spmd", True, 32)
    assert not config.dry_run and config.workdir is None
    with pytest.raises(TypeError, match="dataclass"):
        config_lib.parse(dict, [])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformer_config_override_is_recorded_as_given(tmp_path):
    workdir = tmp_path / "w"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.examples.transformer", "--workdir", str(workdir),
         "--train-steps", "4", "--train-loop-steps", "2", "--d-model", "32", "--num-heads",
         "2", "--partitioner", "spmd", "--learning-rate", "0.005"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("final step=4 ")
    record = json.loads((workdir / "run.json").read_text())
    config = record["config"]
    assert (config["d_model"], config["num_heads"], config["learning_rate"]) == (32, 2, 0.005)
    assert config["partitioner"] == "spmd" and config["seq_len"] == 64  # a default, as given
    assert record["mesh"]["shape"] == {"data": 4, "model": 2}
    assert record["state"]["params"] > 0
    acc = eam.EventAccumulator(str(workdir / "train"), size_guidance={eam.TENSORS: 0})
    acc.Reload()
    (table,) = acc.Tensors("parameters/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert "| params/block0/mlp/up/kernel | (32, 128) | float32 | (None, 'model') |" in text
