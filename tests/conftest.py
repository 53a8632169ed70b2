import os

import numpy as np
import pytest
import torch

os.environ.setdefault("RUST_BACKTRACE", "0")  # tract's errors carry a Rust backtrace otherwise

import gdn_export  # noqa: E402,F401  (registers the ops)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


def make_rule_inputs(batch, seq, key_heads, heads, width_k, width_v, dtype=torch.float32, seed=0):
    """Seq-major operands of gated_delta_rule with gates from the real formulas (FAMILY.md section 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, key_heads, width_k, generator=gen)
    k = torch.randn(batch, seq, key_heads, width_k, generator=gen)
    v = torch.randn(batch, seq, heads, width_v, generator=gen)
    a_log = torch.linspace(0.02, 12.0, heads).log()
    g = -a_log.exp() * torch.nn.functional.softplus(torch.randn(batch, seq, heads, generator=gen) + 1.0)
    beta = torch.rand(batch, seq, heads, generator=gen)
    s0 = 0.5 * torch.randn(batch, heads, width_k, width_v, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), s0


class GatedDeltaRuleModel(torch.nn.Module):
    """The gated delta rule as a graph: inputs q, k, v, g, beta, s0; outputs o, state."""

    def __init__(self, use_qk_l2norm=True, scale=None):
        super().__init__()
        self.use_qk_l2norm, self.scale = use_qk_l2norm, scale

    def forward(self, q, k, v, g, beta, s0):
        return gdn_export.gated_delta_rule(q, k, v, g, beta, s0, scale=self.scale, use_qk_l2norm=self.use_qk_l2norm)


class GatedDeltaScanModel(torch.nn.Module):
    def forward(self, q, k, v, g, beta, s0):
        return torch.ops.t2n_extra.gated_delta_scan(q, k, v, g, beta, s0)


NAMES = dict(input_names=["q", "k", "v", "g", "beta", "s0"], output_names=["o", "state"])
