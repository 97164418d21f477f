"""The `fxfuse` command line: optimize (the other sub-commands test their own)."""

import json
import subprocess
import sys

import pytest

from fxfuse.cli import main


def test_optimize_prints_the_report(capsys):
    assert main(["optimize", "torchvision:resnet18", "--input-shape", "2,3,32,32"]) == 0
    out = capsys.readouterr().out
    assert "21 sites fused, 8 covered, 0 skipped" in out and "layer1.0.{bn1,relu}" in out
    assert all(len(line) <= 100 for line in out.splitlines())
    assert "layer1.0.conv1 + layer1.0.bn1 + layer1.0.relu" not in out  # covered: counted, no row


def test_optimize_verbose_gives_every_full_reason(capsys):
    assert main(["optimize", "torchvision:resnet18", "--input-shape", "2,3,32,32", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "covered layer1.0.conv1 + layer1.0.bn1 + layer1.0.relu (conv2d→batch_norm2d→relu): runs in" in out
    assert "rebuilt in layer1.0.conv2's backward" in " ".join(out.split())  # past the short form
    assert all(len(line) <= 100 for line in out.splitlines())


def test_optimize_json_and_fast_mode(capsys):
    assert (
        main(["optimize", "torchvision:mobilenet_v3_small", "--input-shape", "1,3,32,32", "--mode", "fast", "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "fast" and report["fused"]
    # fast mode recomputes no conv: BN→act sites, merged into the next conv where it is their only user;
    # the 5×5 depthwise convs left get fxfuse's conv backward
    ops = {"fxfuse::batch_norm_act", "fxfuse::bn_act_conv", "fxfuse::conv2d"}
    assert all(site["op"] in ops for site in report["fused"])


def test_factory_spec(capsys):
    assert main(["optimize", "tests.test_cli:small_model", "--input-shape", "2,3,8,8", "--verbose"]) == 0
    assert "(conv2d→batch_norm2d→relu) as fxfuse::conv_bn_act" in capsys.readouterr().out


def small_model():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


@pytest.mark.parametrize(
    "argv", [["optimize", "torchvision:resnet18"], ["optimize", "torchvision:resnet18", "--input-shape", "a,b"]]
)
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["optimize", "torchvision:resnet9000", "--input-shape", "1,3,8,8"]) == 2
    assert "no model 'resnet9000'" in capsys.readouterr().err


def test_python_dash_m_and_help():
    out = subprocess.run([sys.executable, "-m", "fxfuse", "--help"], capture_output=True, text=True, check=True)
    assert "optimize" in out.stdout
