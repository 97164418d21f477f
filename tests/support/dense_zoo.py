"""torchvision dense-prediction models fxfuse is checked on (tests/test_torchvision_dense.py,
benchmarks/zoo_coverage.py): the segmentation models in train mode, and detection backbones,
which normalise with FrozenBatchNorm2d (buffers only, never updated: not a BatchNorm2d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torchvision.models import segmentation
from torchvision.models.detection import backbone_utils
from torchvision.ops.misc import FrozenBatchNorm2d


@dataclass(frozen=True)
class DenseModel:
    name: str
    family: str
    make: Callable[[], nn.Module]
    size: int = 64
    batch: int = 2

    def build(self) -> nn.Module:
        return self.make()

    def example_input(self, batch: int | None = None, size: int | None = None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(batch or self.batch, 3, size or self.size, size or self.size, generator=generator)


def randomize_frozen_batch_norm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every FrozenBatchNorm2d a non-identity affine (a fresh one is exactly x*1+0)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, FrozenBatchNorm2d):
            n = module.weight.numel()
            module.weight.copy_(torch.rand(n, generator=generator) + 0.5)
            module.bias.copy_(torch.randn(n, generator=generator) * 0.1)
            module.running_mean.copy_(torch.randn(n, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
    return model


def _segmentation(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(segmentation, name)(weights=None, weights_backbone=None, num_classes=4)


def _resnet50_fpn() -> nn.Module:
    # trainable_layers=3: conv1 and layer1 are frozen (requires_grad=False), as in Faster R-CNN.
    return randomize_frozen_batch_norm(backbone_utils.resnet_fpn_backbone(backbone_name="resnet50", weights=None))


def _mobilenet_v3_large_fpn() -> nn.Module:
    return randomize_frozen_batch_norm(
        backbone_utils.mobilenet_backbone(backbone_name="mobilenet_v3_large", weights=None, fpn=True)
    )


SEGMENTATION = [
    DenseModel(name, "torchvision segmentation", _segmentation(name))
    for name in ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")
]

DETECTION_BACKBONES = [
    DenseModel("resnet50_fpn_backbone", "torchvision detection backbone (FrozenBatchNorm2d)", _resnet50_fpn, batch=1),
    DenseModel(
        "mobilenet_v3_large_fpn_backbone",
        "torchvision detection backbone (FrozenBatchNorm2d)",
        _mobilenet_v3_large_fpn,
        batch=1,
    ),
]
