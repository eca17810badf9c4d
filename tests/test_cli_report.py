"""`xtrain report script.py [args]`: the script's first step prints the report and exits 0."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--steps", "3", "--batch", "8", "--seq", "16", "--layers", "1", "--d-model", "32", "--heads", "2"]


@pytest.mark.multiprocess
def test_report_prints_the_step_report_without_training():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               XTRAIN_CACHE_DIR="off")
    env.pop("XTRAIN_REPORT_ONLY", None)
    out = subprocess.run([sys.executable, "-m", "xtrain.cli", "report", "examples/train_gpt.py", *TINY],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "xtrain step report (explicit lowering, mesh data=8)" in out.stdout, out.stdout
    assert "wire bytes per axis: data:" in out.stdout
    assert "training state per device (bytes): parameters=" in out.stdout
    assert "done:" not in out.stdout  # no training ran


@pytest.mark.multiprocess
def test_report_of_a_script_that_never_steps_is_an_error(tmp_path):
    script = tmp_path / "no_step.py"
    script.write_text("print('no training step here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               XTRAIN_CACHE_DIR="off")
    out = subprocess.run([sys.executable, "-m", "xtrain.cli", "report", str(script)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "no_step.py finished without calling a compiled training step, so there is no report" in out.stderr


@pytest.mark.unit
def test_plan_validates_every_target_before_running_the_script(tmp_path, capsys):
    from xtrain import cli

    script, ran = tmp_path / "train.py", tmp_path / "ran"
    script.write_text(f"open({str(ran)!r}, 'w').write('the script ran')\n")
    for target in ("emulated:abc", "emulated:0", "trn1.32xlarge:x", "nosuch.2xlarge"):
        assert cli.main(["plan", "--target", target, str(script)]) == 2, target
        assert not ran.exists(), target
    err = capsys.readouterr().err
    assert ("xtrain plan: target 'emulated:abc': after 'emulated:' comes a number of devices, a positive integer "
            "(e.g. emulated:8)") in err
    assert "target 'emulated:0'" in err and "nosuch.2xlarge" in err


@pytest.mark.unit
def test_plan_options_after_the_script_are_named_as_the_scripts(tmp_path, capsys):
    from xtrain import cli

    script = tmp_path / "train.py"
    script.write_text("import sys; print('script args', sys.argv[1:])\n")
    # the script may define --global-batch itself: it gets the flag, and xtrain plan says so
    assert cli.main(["plan", "--target", "trn1.2xlarge", str(script), "--global-batch", "64"]) == 2
    out = capsys.readouterr()
    assert "script args ['--global-batch', '64']" in out.out
    assert (f"xtrain plan: --global-batch after {script} go to the script, not to xtrain plan; xtrain plan's options "
            f"come before the script: xtrain plan --target trn1.2xlarge --global-batch 64 {script} ...") in out.err
