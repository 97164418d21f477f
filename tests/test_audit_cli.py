"""`fxfuse audit`: exit codes, JSON output, error messages."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxfuse.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_module_entry_point_audits_resnet18_cleanly():
    result = subprocess.run(
        [sys.executable, "-m", "fxfuse", "audit", "torchvision:resnet18", "--input-shape", "1,3,64,64"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "channels_last audit of ResNet" in result.stdout
    assert "OK: no op lost channels_last" in result.stdout


def test_losses_exit_1_and_json_goes_to_stdout(capsys):
    # ShuffleNetV2's channel shuffle leaves NCHW tensors that torch.cat then mixes with channels_last ones.
    code = main(["audit", "torchvision:shufflenet_v2_x0_5", "--input-shape", "2,3,64,64", "--json", "--no-backward"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["backward"] is False
    assert {f["op"] for f in report["findings"]} == {"aten.cat.default"}
    assert report["findings"][0]["module"] == "stage2.1"


def test_eval_and_fake_flags_reach_the_audit(capsys):
    code = main(["audit", "torchvision:squeezenet1_1", "--input-shape", "1,3,64,64", "--json", "--eval", "--fake"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["training"] is False and report["fake"] is True and report["backward"] is True


def test_model_rejecting_the_input_exits_2_naming_the_shape(capsys):
    code = main(["audit", "torchvision:resnet18", "--input-shape", "1,4,32,32", "--eval"])
    assert code == 2
    err = capsys.readouterr().err
    assert "fxfuse: error:" in err and "(1, 4, 32, 32)" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["audit", "torchvision:resnet18"],  # --input-shape is required
        ["audit", "torchvision:resnet18", "--input-shape", "1,three,8,8"],
        ["audit", "torchvision:resnet18", "--input-shape", "1,3,8,8", "--bogus"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_unknown_model_exits_2(capsys):
    assert main(["audit", "torchvision:no_such_net", "--input-shape", "1,3,8,8"]) == 2
    assert "no_such_net" in capsys.readouterr().err
