"""Torch side of gdn_export: the reference math and the custom ops that carry it through export."""

from gdn_export.ops.gated_delta_rule.op import GatedDeltaRule, gated_delta_rule
from gdn_export.ops.gated_delta_rule.scan_op import gated_delta_scan
from gdn_export.ops.gated_delta_rule.naive import gated_delta_recurrence, l2norm

__all__ = ["GatedDeltaRule", "gated_delta_recurrence", "gated_delta_rule", "gated_delta_scan", "l2norm"]
