"""fxfuse.integrations.lightning: a short float64 `fit` with FxfuseCallback computes what the same fit
computes without it (losses, weights, optimizer state, running statistics, outputs), also across a
checkpoint save and a resumed fit."""

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from fxfuse.errors import ConfigurationError  # noqa: E402
from fxfuse.fusion import is_optimized  # noqa: E402
from fxfuse.integrations.lightning import FxfuseCallback, batch_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = dict(rtol=1e-9, atol=1e-11)


def net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


class Classifier(pl.LightningModule):
    """training_step calls `self.model` directly; there is no forward of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = net().double()
        self.loss = nn.CrossEntropyLoss()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self.model(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def predict(self, x):
        return self.model(x)


class Flat(Classifier):
    """The layers on the LightningModule itself, called through its own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        del self.model
        self.stem = net()[:3].double()
        self.head = net()[3:].double()

    def forward(self, x):
        return self.head(self.stem(x))

    def predict(self, x):
        return self(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self(x), y)
        self.losses.append(loss.detach().clone())
        return loss


def loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (8,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(module, callbacks=(), epochs=1, ckpt_path=None, save=None):
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer


def assert_same_training(a, b, trainer_a, trainer_b):
    assert len(a.losses) == len(b.losses) > 0
    for la, lb in zip(a.losses, b.losses):
        torch.testing.assert_close(la, lb, **TOL)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    oa, ob = trainer_a.optimizers[0].state_dict(), trainer_b.optimizers[0].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for i in oa["state"]:
        torch.testing.assert_close(oa["state"][i]["momentum_buffer"], ob["state"][i]["momentum_buffer"], **TOL)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for train in (True, False):
        a.train(train), b.train(train)
        with torch.no_grad():
            torch.testing.assert_close(a.predict(x), b.predict(x), **TOL)


@pytest.mark.parametrize(
    "options",
    [{}, {"memory_budget": 0.5, "memory_format": "channels_last"}],
    ids=["defaults", "budget-channels_last"],
)
def test_fit_is_eagers_fit(options):
    eager, fused = Classifier(), Classifier()
    callback = FxfuseCallback(**options)
    trainer_eager, trainer_fused = fit(eager), fit(fused, [callback])
    assert is_optimized(fused.model) and not is_optimized(fused)
    assert callback.report is fused.model.fxfuse_report and callback.report.fused
    assert callback.report.budget == options.get("memory_budget")  # the options reached optimize
    assert callback.report.layout.startswith(options.get("memory_format", "as given"))
    assert_same_training(eager, fused, trainer_eager, trainer_fused)


def test_checkpoint_resume(tmp_path):
    """An fxfuse fit saves the checkpoint eager saves; a new Trainer resuming from it with the callback
    trains on as an uninterrupted eager fit does."""
    eager = Classifier()
    trainer_eager = fit(eager, epochs=2)
    first, plain = Classifier(), Classifier()
    fit(first, [FxfuseCallback()], save=tmp_path / "fused.ckpt")
    fit(plain, save=tmp_path / "plain.ckpt")
    fused_ckpt = torch.load(tmp_path / "fused.ckpt", weights_only=False)
    plain_ckpt = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    assert fused_ckpt["state_dict"].keys() == plain_ckpt["state_dict"].keys()
    for k, v in plain_ckpt["state_dict"].items():
        torch.testing.assert_close(fused_ckpt["state_dict"][k], v, **TOL)
    resumed = Classifier()
    callback = FxfuseCallback()
    trainer_resumed = fit(resumed, [callback], epochs=2, ckpt_path=tmp_path / "fused.ckpt")
    assert is_optimized(resumed.model) and callback.report.fused
    resumed.losses = first.losses + resumed.losses
    assert_same_training(eager, resumed, trainer_eager, trainer_resumed)


def test_module_itself_when_it_holds_the_layers():
    eager, fused = Flat(), Flat()
    callback = FxfuseCallback()
    assert callback.network(fused) is fused
    trainer_eager, trainer_fused = fit(eager), fit(fused, [callback])
    assert is_optimized(fused) and callback.report.fused
    assert_same_training(eager, fused, trainer_eager, trainer_fused)


def test_network_not_called_is_a_warning():
    class Direct(Flat):
        def training_step(self, batch, batch_idx):  # bypasses forward, which fxfuse optimized
            x, y = batch
            return self.loss(self.head(self.stem(x)), y)

    with pytest.warns(UserWarning, match="did not call it.*module_name"):
        fit(Direct(), [FxfuseCallback()])


def test_options_and_names_are_checked():
    with pytest.raises(ConfigurationError, match="mode"):
        FxfuseCallback(mode="fastest")
    with pytest.raises(ConfigurationError, match="memory_budget"):
        FxfuseCallback(memory_budget=1.5)
    with pytest.raises(ConfigurationError, match="memory_format"):
        FxfuseCallback(memory_format="nhwc")
    with pytest.raises(ConfigurationError, match="backbone.*'model'"):
        FxfuseCallback(module_name="backbone").network(Classifier())
    assert FxfuseCallback(module_name="model.0").network(Classifier()) is not None
    with pytest.raises(ConfigurationError, match="no forward of its own.*'model', 'other'"):
        FxfuseCallback().network(Heads())


class Heads(Classifier):
    """Two networks and no forward: which one is meant is for the user to say."""

    def __init__(self):
        super().__init__()
        self.other = net()


def test_import_fxfuse_imports_no_trainer():
    code = "import sys, fxfuse, fxfuse.integrations; print(sorted({'lightning', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_batch_inputs():
    x = torch.zeros(1)
    assert batch_inputs(x) is x
    assert batch_inputs((x, 1)) is x
    assert batch_inputs({"pixel_values": x, "labels": 1}) is x
    with pytest.raises(ConfigurationError, match="example_inputs"):
        batch_inputs({"a": x})
