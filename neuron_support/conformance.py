"""Does a compiled program fit Neuron? Rules over the HLO text of a compiled step.

    findings = check(step.compiled(*batch).as_text(), Target.for_instance("trn1.32xlarge"))

Every finding names the rule, the HLO op, where it came from (the op_name metadata: jaxpr
path and, for torch models, the aten op; plus the user's file:line when recorded) and the fix.

Facts are from the AWS Neuron documentation (awsdocs-neuron.readthedocs-hosted.com): permitted
replica groups inside a trn1 node and permutes only around rings of adjacent ranks ("Neuron
Collective Communication"), the cap on distinct replica groups per program (the Neuron
runtime's NEC_MAX_COMM_N; 16 in older releases), and the ops and dtypes Neuron does not support
("JAX NeuronX" known issues: lax.cond, dynamic while loops, host callbacks, complex and fp64,
int64 narrowed to int32). The program read is
XLA's optimized HLO for the backend it was compiled for (CPU in emulation: CPU passes may
merge collectives, but they neither add nor remove the ops these rules look at), or the
program lowered for Neuron without its devices (`step.lower(*batch, platform="neuron")`,
`.as_text(dialect="hlo")`: what the Neuron compiler receives, before any pass).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Iterable

from neuron_support import topology
from neuron_support.hlo import Instruction, Module, parse, static_trip_count
from xtrain.errors import ConformanceError, OptionsError  # ConformanceError: re-exported
from xtrain.ir.hlo import replica_groups as replica_groups_of  # the one parser of HLO groups

# Distinct replica groups one compiled program may use, by Neuron runtime. Which releases moved
# from one to the other is not recorded here; the stricter limit is the default.
REPLICA_GROUP_LIMITS = {
    "older-docs": 16,      # older Neuron documentation
    "recent-runtime": 12,  # NEC_MAX_COMM_N in a recent Neuron runtime header
}
DEFAULT_RUNTIME = "recent-runtime"

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_SORT_DIRECTIONS = {"LT", "LE", "GT", "GE"}


class Severity(str, enum.Enum):
    ERROR = "error"        # fails to compile or run on Neuron
    WARNING = "warning"    # runs, but not as written (e.g. int64 downcast to int32)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One way a program does not fit Neuron."""

    rule: str          # rule id, e.g. "replica-group-size"
    op: str            # the HLO op, e.g. "all-reduce %all-reduce.3"
    source: str        # op_name metadata (jaxpr path / torch op), and file:line when known
    message: str       # what is wrong and how to fix it
    severity: Severity = Severity.ERROR

    def __str__(self) -> str:
        return f"[{self.severity.value}] {self.rule}: {self.op} ({self.source or 'no source recorded'}): {self.message}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """What the program must fit.

    Attributes:
        name: for messages, e.g. "trn1.32xlarge".
        devices_per_node: devices (NeuronCores) in one instance; device ids are node-major.
        group_sizes: replica-group sizes permitted inside one node (None: no restriction).
        max_replica_groups: distinct replica groups one program may use (None: no cap).
        ring_permutes: collective-permutes must follow rings of adjacent ranks.
        check_ops: flag ops and dtypes Neuron does not support.
    """

    name: str
    devices_per_node: int
    group_sizes: tuple[int, ...] | None
    max_replica_groups: int | None
    ring_permutes: bool = True
    check_ops: bool = True

    @classmethod
    def for_instance(cls, name: str, *, runtime: str = DEFAULT_RUNTIME,
                     devices_per_node: int | None = None) -> "Target":
        """The target for an instance type; `devices_per_node` shrinks a node for emulation."""
        t = topology.instance(name)
        if runtime not in REPLICA_GROUP_LIMITS:
            raise OptionsError(f"runtime={runtime!r} is not one of {', '.join(map(repr, REPLICA_GROUP_LIMITS))}")
        neuron = t.backend is topology.Backend.NEURON
        per_node = devices_per_node or t.devices
        sizes = tuple(s for s in t.node_group_sizes if s <= per_node) if t.node_group_sizes else None
        return cls(name=t.name, devices_per_node=per_node, group_sizes=sizes,
                   max_replica_groups=REPLICA_GROUP_LIMITS[runtime] if neuron else None,
                   ring_permutes=neuron, check_ops=neuron)


def _source(ins: Instruction) -> str:
    return " at ".join(p for p in (ins.op_name, ins.location) if p)


def _finding(rule: str, ins: Instruction, message: str, severity: Severity = Severity.ERROR) -> Finding:
    return Finding(rule, f"{ins.opcode} %{ins.name}", _source(ins), message, severity)


# -- unsupported ops ----------------------------------------------------------------------------
# One function per rule: (instruction, module, target) -> findings.

def _conditional(ins, module, target):
    yield _finding("conditional", ins, "lax.cond / lax.switch (HLO conditional) is not supported on Neuron; "
                   "compute both branches and pick with jnp.where, or move the branch out of the step")


def _dynamic_while(ins, module, target):
    if static_trip_count(module, ins) is None:
        yield _finding("dynamic-while", ins, "while loop whose trip count is not static (lax.while_loop on "
                       "data); Neuron needs static loops: use lax.fori_loop or lax.scan with fixed bounds")


def _host_callback(ins, module, target):
    call = ins.attribute("custom_call_target") or ""
    if "callback" in call.lower() or "host" in call.lower():
        yield _finding("host-callback", ins, f"host callback (custom-call {call!r}, from jax.pure_callback / "
                       "io_callback / jax.debug) cannot run inside a Neuron program; move it outside the step")


def _integer_dot(ins, module, target):
    types = ins.dtypes | {d for o in ins.operands for d in _dtypes_of(module, ins.computation, o)}
    ints = sorted(d for d in types if d[0] in "su" and d != "s1")
    if ints:
        yield _finding("integer-dot", ins, f"integer matrix multiply ({', '.join(ints)}) is not supported on "
                       "Neuron; cast the operands to float32 or bfloat16 first")


def _variadic_reduce(ins, module, target):
    if ins.shape.startswith("("):
        yield _finding("variadic-reduce", ins, f"variadic reduce {ins.shape} (several arrays reduced together; "
                       "jnp.argmax/argmin produce one) is not supported on Neuron; reduce the values first "
                       "(max), then find the index with jnp.where over an iota and a min")


def _sort_comparator(ins, module, target):
    comparator = ins.attribute("to_apply")
    directions = {d for name in module.called(comparator or "") for c in module.computations[name]
                  if c.opcode == "compare" for d in [c.attribute("direction")] if d}
    bad = sorted(directions - _SORT_DIRECTIONS)
    if bad:
        yield _finding("sort-comparator", ins, f"sort comparator uses {'/'.join(bad)} besides LT/LE/GT/GE "
                       "(JAX adds them for NaN and -0.0 ordering of floats and for tie-breaks between keys); "
                       "Neuron accepts only LT/LE/GT/GE comparators: sort one integer key, or use lax.top_k")


def _reduce_precision(ins, module, target):
    yield _finding("reduce-precision", ins, "lax.reduce_precision is not supported on Neuron; cast with "
                   "astype(jnp.bfloat16) and back instead")


def _dtypes_of(module: Module, computation: str, name: str) -> set[str]:
    shape = module.shape_of(computation, name)
    return Instruction(name, shape, "", "", computation, "", "").dtypes


_DTYPE_RULES = {
    "f64": ("fp64", Severity.ERROR, "float64 is not supported on trn1; use float32 (turn off jax_enable_x64, "
            "pass float32 arrays)"),
    "c64": ("complex", Severity.ERROR, "complex dtypes (c64, e.g. from jnp.fft) are not supported on Neuron"),
    "c128": ("complex", Severity.ERROR, "complex dtypes (c128) are not supported on Neuron"),
    "s64": ("int64", Severity.WARNING, "int64 will be downcast to int32 by the Neuron compiler; values past "
            "2**31 wrap: use int32 explicitly"),
    "u64": ("int64", Severity.WARNING, "uint64 will be downcast to uint32 by the Neuron compiler; use uint32"),
}


def _dtypes(module: Module) -> Iterable[Finding]:
    """One finding per (dtype, source op), preferring ops that name their source: an f64
    program would otherwise repeat on every constant and parameter."""
    hits: dict[str, dict[str, Instruction]] = {}
    for ins in module.instructions():
        for dtype in ins.dtypes & _DTYPE_RULES.keys():
            if ins.opcode not in ("parameter", "constant") or not ins.op_name:
                hits.setdefault(dtype, {}).setdefault(ins.op_name, ins)
    for dtype in sorted(hits):
        named = [ins for op_name, ins in hits[dtype].items() if op_name] or list(hits[dtype].values())[:1]
        rule, severity, message = _DTYPE_RULES[dtype]
        yield from (_finding(rule, ins, message, severity) for ins in named)


# -- collectives ---------------------------------------------------------------------------------

def _groups(ins: Instruction, module: Module) -> list[list[int]]:
    """Physical device ids of each replica group."""
    groups = replica_groups_of(f"{ins.opcode}({ins.args}") or [list(range(module.num_devices))]  # {}: all
    return [module.physical(g) for g in groups]


def _aligned(local: list[int], sizes: tuple[int, ...], per_node: int) -> bool:
    """Contiguous cores [k*s, (k+1)*s), or the strided other half of such a split: s cores
    k apart inside an aligned block of s*k (data groups under tensor parallelism)."""
    s, first = len(local), local[0]
    stride = local[1] - local[0] if s > 1 else 1
    if s not in sizes or local != list(range(first, first + s * stride, stride)):
        return False
    if stride == 1:
        return first % s == 0
    return stride in sizes and per_node % (s * stride) == 0 and (first - first % stride) % (s * stride) == 0


def _group_problem(group: list[int], target: Target) -> str | None:
    """Why one replica group breaks the node rules, or None."""
    per_node, sizes = target.devices_per_node, target.group_sizes
    by_node: dict[int, list[int]] = {}
    for d in sorted(group):
        by_node.setdefault(d // per_node, []).append(d % per_node)
    locals_ = list(by_node.values())
    if len(by_node) > 1 and any(loc != locals_[0] for loc in locals_):
        return (f"group {sorted(group)} spans nodes {sorted(by_node)} with different cores on each; a group "
                "across nodes must take the same core indices on every node it spans")
    if sizes and not _aligned(locals_[0], sizes, per_node):
        where = "inside a node" if len(by_node) == 1 else "on each node it spans"
        return (f"group {sorted(group)} takes cores {locals_[0]} {where}; {target.name} allows groups of "
                f"{', '.join(map(str, sizes))} cores starting at a multiple of the size")
    return None


def _replica_groups(ins, module, target):
    for group in _groups(ins, module):
        problem = _group_problem(group, target)
        if problem:
            yield _finding("replica-groups", ins, f"{problem}; make the mesh axis this collective runs over "
                           f"a permitted size (e.g. 2, 4 or 8 on trn1) laid over neighbouring cores")
            return


def _rings(pairs: list[tuple[int, int]]) -> dict[int, list[int]]:
    """rank -> the sorted ranks connected to it by the permute's pairs."""
    parent = {x: x for p in pairs for x in p}

    def root(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for s, t in pairs:
        parent[root(s)] = root(t)
    members: dict[int, list[int]] = {}
    for x in sorted(parent):
        members.setdefault(root(x), []).append(x)
    return {x: members[root(x)] for x in parent}


def _ring_step(s: int, t: int, ring: list[int], per_node: int) -> bool:
    """Adjacent ranks (stride 1), or the same core on adjacent nodes (stride = cores per node),
    or the edge that closes such a ring (last -> first)."""
    for stride in {1, per_node}:
        closes = {s, t} == {ring[0], ring[-1]} and ring == list(range(ring[0], ring[-1] + 1, stride))
        if abs(s - t) == stride or closes:
            return True
    return False


def _ring_problem(pairs: list[tuple[int, int]], target: Target) -> str | None:
    rings = _rings(pairs)
    for s, t in pairs:
        if s != t and not _ring_step(s, t, rings[s], target.devices_per_node):
            return f"{s} -> {t} is not a step between adjacent ranks"
    return None


def _permute_ring(ins, module, target):
    if not target.ring_permutes:
        return
    pairs = [tuple(module.physical(p)) for p in replica_groups_of(f"{ins.opcode}({ins.args}")]
    problem = _ring_problem(pairs, target)
    if problem:
        yield _finding("permute-ring", ins, f"collective-permute {problem} (pairs {pairs[:8]}"
                       f"{' ...' if len(pairs) > 8 else ''}); Neuron permutes only around rings of physically "
                       "adjacent ranks: shift by one along a mesh axis laid over neighbouring cores "
                       "(lax.ppermute with perm [(i, (i + 1) % n)])")


def _distinct_groups(module: Module, target: Target) -> Iterable[Finding]:
    if target.max_replica_groups is None:
        return
    seen: dict[tuple, Instruction] = {}
    for ins in module.instructions():
        if _base(ins.opcode) in _COLLECTIVES:
            seen.setdefault(tuple(tuple(sorted(g)) for g in sorted(_groups(ins, module))), ins)
    if len(seen) > target.max_replica_groups:
        first = list(seen.values())[target.max_replica_groups]
        yield _finding("replica-group-count", first,
                       f"the program uses {len(seen)} distinct replica groups; the Neuron runtime allows "
                       f"{target.max_replica_groups} per program: use fewer mesh-axis combinations in collectives "
                       "(e.g. reduce over ('data', 'tensor') once instead of over each axis)")


# -- the rule table ------------------------------------------------------------------------------

OP_RULES: dict[str, tuple[Callable, ...]] = {
    "conditional": (_conditional,),
    "while": (_dynamic_while,),
    "custom-call": (_host_callback,),
    "dot": (_integer_dot,),
    "reduce": (_variadic_reduce,),
    "sort": (_sort_comparator,),
    "reduce-precision": (_reduce_precision,),
    "all-reduce": (_replica_groups,),
    "all-gather": (_replica_groups,),
    "reduce-scatter": (_replica_groups,),
    "all-to-all": (_replica_groups,),
    "collective-permute": (_permute_ring,),
}
_COLLECTIVE_RULES = {_replica_groups, _permute_ring}


def _base(opcode: str) -> str:
    return opcode[:-len("-start")] if opcode.endswith("-start") else opcode


def _op_findings(module: Module, target: Target) -> Iterable[Finding]:
    for ins in module.instructions():
        for rule in OP_RULES.get(_base(ins.opcode), ()):
            if rule in _COLLECTIVE_RULES or target.check_ops:
                yield from rule(ins, module, target)


def check(hlo_text: str, target: Target | None = None, *,
          device_ids: list[int] | None = None) -> list[Finding]:
    """Every way the program breaks the target's rules (empty when it conforms).

    Args:
        hlo_text: HLO module text, e.g. `step.compiled(*batch).as_text()`.
        target: what to check against; `Target.for_instance("trn1.32xlarge")` by default.
        device_ids: the physical rank (node-major device id) of each logical device id of the
            program (`emulate.device_order(compiled)`); by default logical ids are physical.
    """
    target = target or Target.for_instance("trn1.32xlarge")
    module = parse(hlo_text)
    module.device_ids = device_ids
    findings = list(_op_findings(module, target))
    if target.check_ops:
        findings += _dtypes(module)
    findings += _distinct_groups(module, target)
    return findings


def assert_conforms(hlo_text: str, target: Target | None = None, *, allow: Iterable[str] = (),
                    device_ids: list[int] | None = None) -> list[Finding]:
    """Raises ConformanceError on any error-severity finding whose rule is not in `allow`;
    returns the remaining findings (warnings and allowed rules)."""
    target = target or Target.for_instance("trn1.32xlarge")
    findings = check(hlo_text, target, device_ids=device_ids)
    errors = [f for f in findings if f.severity is Severity.ERROR and f.rule not in set(allow)]
    if errors:
        raise ConformanceError(errors, target.name)
    return findings
