"""Models from libraries nobody here wrote (the "wild zoo", issue 30): HF transformers vision models,
ultralytics YOLO, segmentation_models_pytorch, efficientnet_pytorch, and torchvision models with auxiliary
outputs. Random weights only, no downloads. Each entry imports its library when built, so a missing
library skips only its own models (tests/test_wild_zoo.py, benchmarks/zoo_coverage.py --zoo wild).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("YOLO_OFFLINE", "1")


@dataclass(frozen=True)
class WildModel:
    name: str
    family: str
    library: str  # the module a test importorskips
    make: Callable[[], nn.Module]
    size: int = 64
    batch: int = 2

    def build(self) -> nn.Module:
        importlib.import_module(self.library)
        with contextlib.redirect_stdout(io.StringIO()):  # ultralytics prints its layer table
            return self.make()

    def example_input(self, batch: int | None = None, size: int | None = None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(batch or self.batch, 3, size or self.size, size or self.size, generator=generator)


class LastHidden(nn.Module):
    """An HF model as users call it in a training loop: the output's last hidden state (a tensor)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


def _hf(model: str, config: str, **kwargs) -> Callable[[], nn.Module]:
    def make():
        import transformers

        return LastHidden(getattr(transformers, model)(getattr(transformers, config)(**kwargs)))

    return make


def _yolo(cfg: str, classify: bool = False) -> Callable[[], nn.Module]:
    def make():
        from ultralytics.nn.tasks import ClassificationModel, DetectionModel

        return (ClassificationModel if classify else DetectionModel)(cfg, verbose=False)

    return make


def _smp(arch: str, encoder: str) -> Callable[[], nn.Module]:
    def make():
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, classes=3)

    return make


def _efficientnet_pytorch() -> nn.Module:
    from efficientnet_pytorch import EfficientNet

    return EfficientNet.from_name("efficientnet-b0")


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    def make():
        import torchvision

        return getattr(torchvision.models, name)(weights=None, init_weights=False, aux_logits=True, **kwargs)

    return make


WILD = [
    WildModel("hf_resnet", "HF transformers", "transformers", _hf("ResNetModel", "ResNetConfig")),
    WildModel("hf_regnet", "HF transformers", "transformers", _hf("RegNetModel", "RegNetConfig")),
    WildModel(
        "hf_mobilenet_v2_tf_padding",
        "HF transformers",
        "transformers",
        _hf("MobileNetV2Model", "MobileNetV2Config", tf_padding=True),
    ),
    WildModel(
        "hf_mobilenet_v2",
        "HF transformers",
        "transformers",
        _hf("MobileNetV2Model", "MobileNetV2Config", tf_padding=False),
    ),
    WildModel("hf_efficientnet", "HF transformers", "transformers", _hf("EfficientNetModel", "EfficientNetConfig")),
    WildModel("hf_convnext", "HF transformers", "transformers", _hf("ConvNextModel", "ConvNextConfig")),
    WildModel(
        "hf_vit",
        "HF transformers",
        "transformers",
        _hf(
            "ViTModel",
            "ViTConfig",
            image_size=64,
            patch_size=16,
            hidden_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=192,
        ),
    ),  # fmt: skip
    WildModel(
        "hf_mobilevit", "HF transformers", "transformers", _hf("MobileViTModel", "MobileViTConfig", image_size=64)
    ),
    WildModel("hf_levit", "HF transformers", "transformers", _hf("LevitModel", "LevitConfig"), size=224),
    WildModel("yolov8n", "ultralytics", "ultralytics", _yolo("yolov8n.yaml"), size=64),
    WildModel("yolo11n", "ultralytics", "ultralytics", _yolo("yolo11n.yaml"), size=64),
    WildModel("yolov8n_cls", "ultralytics", "ultralytics", _yolo("yolov8n-cls.yaml", classify=True), size=64),
    WildModel(
        "smp_unet_resnet18", "segmentation_models_pytorch", "segmentation_models_pytorch", _smp("Unet", "resnet18")
    ),
    WildModel(
        "smp_fpn_mobilenet_v2",
        "segmentation_models_pytorch",
        "segmentation_models_pytorch",
        _smp("FPN", "mobilenet_v2"),
    ),
    WildModel(
        "smp_deeplabv3plus_efficientnet_b0",
        "segmentation_models_pytorch",
        "segmentation_models_pytorch",
        _smp("DeepLabV3Plus", "efficientnet-b0"),
    ),
    WildModel("efficientnet_pytorch_b0", "efficientnet_pytorch", "efficientnet_pytorch", _efficientnet_pytorch),
    WildModel("googlenet_aux", "torchvision aux outputs", "torchvision", _torchvision("googlenet"), size=64),
    WildModel("inception_v3_aux", "torchvision aux outputs", "torchvision", _torchvision("inception_v3"), size=299),
]
BY_NAME = {m.name: m for m in WILD}
