"""What the explicit lowering does when a split operand reaches a primitive it has no partition
rule for (Plan(fallback=..., fallback_modules=...)).

    error      (default) the first step raises xtrain.errors.UnsupportedOpError naming the
               primitive, the module, the operand's split and the bytes a replicated run gathers
    replicate  the operands are gathered and the op runs whole on every device; the report's
               collectives table marks those gathers as fallbacks, the cost model charges them

`fallback_modules` are fnmatch patterns over module paths where "replicate" is allowed while the
rest of the model keeps "error" (like remat_keep / fp32_modules).
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch


class Fallback(str, enum.Enum):
    ERROR = "error"
    REPLICATE = "replicate"


@dataclasses.dataclass(frozen=True)
class FallbackPolicy:
    """Where a primitive without a rule may run replicated."""

    mode: Fallback = Fallback.ERROR
    modules: tuple[str, ...] = ()

    def allows(self, path: str) -> bool:
        """Whether an op of module `path` may be gathered and run replicated."""
        return self.mode is Fallback.REPLICATE or any(fnmatch.fnmatchcase(path, p) for p in self.modules)

    @property
    def setting(self) -> str:
        """The Plan arguments that give this policy."""
        return f"fallback={self.mode.value!r}" + (f", fallback_modules={self.modules!r}" if self.modules else "")


REPLICATE = FallbackPolicy(Fallback.REPLICATE)
