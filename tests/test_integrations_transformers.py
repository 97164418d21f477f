"""fxfuse.integrations.transformers: a few float64 HF Trainer steps with FxfuseCallback compute what the
same Trainer run computes without it (weights, optimizer state, running statistics, outputs), for
ResNet, ConvNeXt and MobileNetV2 built from configs (random weights, no download), and with
TrainingArguments(gradient_checkpointing=True) on and off for a conv/BN model that supports it (SwiftFormer:
in transformers 5.23, ResNet, ConvNeXt and MobileNetV2 do not, and the Trainer raises for them)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fxfuse.errors import ConfigurationError  # noqa: E402
from fxfuse.fusion import is_optimized  # noqa: E402
from fxfuse.integrations.transformers import FxfuseCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

# atol: a conv bias before a BatchNorm has a gradient of exactly 0 in exact arithmetic, and of rounding noise
# (~1e-17) in float64, different in eager and fused; AdamW divides it by its own magnitude, moving that bias by
# ~lr * 1e-9 per step in both runs, in different directions.
TOL = dict(rtol=1e-9, atol=1e-10)
SIZE = 32


def resnet():
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    return transformers.ResNetForImageClassification(config)


def convnext():
    config = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2, num_labels=3)
    return transformers.ConvNextForImageClassification(config)


def mobilenet_v2():
    config = transformers.MobileNetV2Config(image_size=SIZE, depth_multiplier=0.25, num_labels=3)
    return transformers.MobileNetV2ForImageClassification(config)


def swiftformer():
    config = transformers.SwiftFormerConfig(
        image_size=SIZE, depths=[1, 1], embed_dims=[8, 16], downsamples=[True, True], num_labels=3
    )
    return transformers.SwiftFormerForImageClassification(config)


class Images(torch.utils.data.Dataset):
    def __init__(self, n=8):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, SIZE, SIZE, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def build(make):
    torch.manual_seed(0)
    return make().double()


def train(model, tmp_path, callbacks=(), checkpointing=False, steps=2):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        activation_checkpointing=checkpointing,  # transformers 5's name; gradient_checkpointing is its alias
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Images(), callbacks=list(callbacks))
    trainer.train()
    return trainer


def assert_same_training(a, b, trainer_a, trainer_b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    oa, ob = trainer_a.optimizer.state_dict(), trainer_b.optimizer.state_dict()
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) > 0
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            torch.testing.assert_close(v, ob["state"][i][k], **TOL)
    x = torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for mode in (True, False):
        a.train(mode), b.train(mode)
        with torch.no_grad():
            torch.manual_seed(3)  # the same dropout masks
            out_a = a(pixel_values=x).logits
            torch.manual_seed(3)
            torch.testing.assert_close(out_a, b(pixel_values=x).logits, **TOL)


# MobileNetV2's 17 blocks are fixed by its config: optimizing it takes ~30 s on a 2-core VM, so it runs in make zoo.
@pytest.mark.parametrize("make", [resnet, convnext, pytest.param(mobilenet_v2, marks=pytest.mark.zoo)])
def test_trainer_is_eagers_trainer(make, tmp_path):
    eager, fused = build(make), build(make)
    callback = FxfuseCallback()
    trainer_eager = train(eager, tmp_path / "eager")
    trainer_fused = train(fused, tmp_path / "fused", [callback])
    # ConvNextModel's own forward does not trace (its children are optimized instead); the others' does.
    assert any(is_optimized(m) for m in fused.base_model.modules()) and not is_optimized(fused)
    assert callback.report is fused.base_model.fxfuse_report and callback.report.fused
    assert_same_training(eager, fused, trainer_eager, trainer_fused)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_gradient_checkpointing(checkpointing, tmp_path):
    eager, fused = build(swiftformer), build(swiftformer)
    callback = FxfuseCallback()
    trainer_eager = train(eager, tmp_path / "eager", checkpointing=checkpointing)
    trainer_fused = train(fused, tmp_path / "fused", [callback], checkpointing=checkpointing)
    switches = [m.gradient_checkpointing for m in fused.modules() if hasattr(m, "gradient_checkpointing")]
    assert switches and all(s == checkpointing for s in switches)
    assert is_optimized(fused.base_model) and callback.report.fused
    assert_same_training(eager, fused, trainer_eager, trainer_fused)


def test_options_and_names_are_checked():
    with pytest.raises(ConfigurationError, match="peak_budget"):
        FxfuseCallback(peak_budget=0)
    model = resnet()
    assert FxfuseCallback().network(model) is model.resnet
    assert FxfuseCallback(module_name="").network(model) is model
    with pytest.raises(ConfigurationError, match="'resnet'"):
        FxfuseCallback(module_name="backbone").network(model)
