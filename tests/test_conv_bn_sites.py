"""The zoo's site census (tests/support/conv_bn_sites.py) counts what exists, and matches fxfuse's report."""

import torch
from support.conv_bn_sites import Site, coverage, existing_sites
from torch import nn

import fxfuse


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)  # a site
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)  # conv → relu → bn: not a site
        self.conv3, self.bn3 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)  # a site whose conv output is also added

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.bn2(torch.relu(self.conv2(x)))
        y = self.conv3(x)
        return self.bn3(y) + y


def test_census_finds_conv_fed_batch_norms_only():
    census = existing_sites(Blocks(), (torch.randn(2, 3, 8, 8),))
    assert census.bn_layers == ("bn1", "bn2", "bn3")
    assert census.sites == (Site("conv1", "bn1"), Site("conv3", "bn3"))


def test_census_leaves_the_model_unchanged():
    model = Blocks()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    existing_sites(model, (torch.randn(2, 3, 8, 8),))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_coverage_sorts_sites_into_fused_and_skipped_with_the_reports_reason():
    model, x = Blocks(), torch.randn(2, 3, 8, 8)
    census = existing_sites(model, (x,))
    cov = coverage(census.sites, fxfuse.optimize(model, (x,)).fxfuse_report)
    assert cov.fused == [Site("conv1", "bn1")]
    assert list(cov.skipped) == [Site("conv3", "bn3")]
    assert "other users" in cov.skipped[Site("conv3", "bn3")]
    assert not cov.unseen and cov.ratio == 0.5


def test_coverage_reports_sites_missing_from_the_report_as_unseen():
    report = fxfuse.FusionReport(mode="memory")
    cov = coverage([Site("conv1", "bn1")], report)
    assert cov.unseen == [Site("conv1", "bn1")] and cov.reasons() == {"not seen by the pass": 1}
