"""The built-in passes in pipeline order, and the checks of `CompileConfig.disabled_passes` and
`enabled_passes` against them.

Apart from the pass manager (manager.py), which is Inductor's `CustomGraphPass` and so imports Inductor:
loading an artifact checks its passes' uuids against these without importing Inductor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from graphkiln.errors import ConfigError

from .add_rms_norm import AddRmsNorm
from .attention_split import AttentionSplit
from .base import Pass
from .fp8_mlp import Fp8Mlp
from .fp8_norm_quant import Fp8NormQuant
from .int4_norm_words import Int4NormWords
from .linear_op import LinearOp
from .rope_attention import RopeAttention
from .silu_mul_epilogue import SiluMulEpilogue
from .silu_mul_linear import SiluMulLinear
from .symm_mem_all_reduce import SymmMemAllReduce


def default_passes(extra: Sequence[Pass] = ()) -> list[Pass]:
    """Built-in passes in pipeline order; `extra` Dynamo-graph passes run just before the split."""
    return [SiluMulEpilogue(), Fp8Mlp(), SiluMulLinear(), AddRmsNorm(), Fp8NormQuant(), Int4NormWords(),
            RopeAttention(), *extra, AttentionSplit(), LinearOp(), SymmMemAllReduce()]


def check_disabled(passes: Sequence[Pass], disabled: Iterable[str], field: str = "disabled_passes") -> frozenset[str]:
    """`disabled` (or the names in CompileConfig's `field`) as a set, or a ConfigError naming the unknown
    names and the known passes."""
    known = [p.name for p in passes]
    unknown = sorted(set(disabled) - set(known))
    if unknown:
        raise ConfigError(f"CompileConfig.{field}: unknown pass {', '.join(unknown)}; known: {', '.join(known)}")
    return frozenset(disabled)


def passes_off(passes: Sequence[Pass], disabled: Iterable[str], enabled: Iterable[str] = (),
               device: str = "cpu") -> frozenset[str]:
    """The passes that do not run in a compile for `device`: those `disabled` names, and those off by default
    there (`Pass.default_devices`) that `enabled` does not name."""
    on = check_disabled(passes, enabled, "enabled_passes")
    off_here = {p.name for p in passes if device not in p.default_devices and p.name not in on}
    return check_disabled(passes, disabled) | off_here
