"""The students of fine-tuned recovery and the teacher they learn from, over one set of blocks.

Each student (`DistillConfig.specs`) is a view that starts as a copy of its method's fitted view (operators and
MLP maps), and each part it trains (`distill.train`, the table of `distill.parts`) makes its own copies or
adapters and names its parameters. Copies are per student, so two students of one method train independently
and the teacher and the training-free views keep the originals; a ``lora`` adapter is active only while its view
runs, so every other view, the teacher first, computes bit for bit the base model's output.

The teacher is the dense view: frozen, eval mode, no gradients. A student whose blocks before block i compute
what the teacher's do (nothing trains there: i is its first gap, or the first block it trains) starts from the
residual stream entering block i, kept by the teacher pass (taken as its input embeddings, the blocks before i
skipped); `check_prefix` verifies this against a full forward and turns it off where a family transforms its
input embeddings. With a hidden-state term both passes also keep the stream entering the first block after each
gap (`stream_sites`). With the teacher's outputs cached (`teacher_cache`) the teacher pass stops at the last of
those streams (`teacher(batch, logits=False)`), or does not run.

With `precision` bf16 the students' forward runs under `torch.autocast` (bfloat16 matrix products; the
parameters, their gradients and the optimizer state stay float32); the teacher never does.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..core.head import decoder_of, output_head
from ..core.model import model_inputs
from ..core.views import DENSE, PrunedModel
from .config import DistillConfig, Student
from .interface import get_part, parts
from .parts import stream_sites
from .teacher_cache import TeacherCache

# oneDNN ISA caps (`ONEDNN_MAX_CPU_ISA`) under which it still has bfloat16 kernels of its own
_ONEDNN_BF16_ISAS = frozenset(
    "ALL DEFAULT AVX512_CORE_BF16 AVX512_CORE_FP16 AVX512_CORE_AMX AVX512_CORE_AMX_FP16 AVX10_1_512 AVX10_1_512_AMX "
    "AVX10_1_512_AMX_FP16 AVX10_2_512 AVX10_2_512_AMX_2".split()
)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 matrix products natively (a CPU without AVX-512 BF16 or AMX takes a
    scalar path for some of them, hundreds of times slower: docs/gpu.md).

    On a CPU the hardware is not enough: with ATen held below AVX-512 (`ATEN_CPU_CAPABILITY`) or oneDNN capped
    below its bfloat16 kernels (`ONEDNN_MAX_CPU_ISA`) the products are emulated, and a bf16 distillation step
    ran 8 to 9 times slower than float32 on an AVX-512 BF16 CPU so capped (docs/benchmarks.md)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    aten = torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper() in _ONEDNN_BF16_ISAS
    return hardware and aten and onednn


class _Enough(Exception):
    """Raised by the last tap of a partial teacher pass: everything it must give is captured."""


class StudentParams(dict):
    """A student's trainable parameters by part (`distill.parts`: each part has its own learning rate)."""

    def all(self) -> list[nn.Parameter]:
        return [p for params in self.values() for p in params]


@dataclass
class TeacherPass:
    """The dense model's final hidden states (after the final norm), the residual stream entering each
    block a student starts from (`prefixes`), and with a hidden-state term the stream entering the first
    block after each gap (`streams`)."""

    hidden: torch.Tensor | None  # None: a partial pass (the logits come from the cache)
    prefixes: dict[int, torch.Tensor]
    streams: list[torch.Tensor] | None = None


@dataclass
class StudentPass:
    hidden: torch.Tensor
    streams: list[torch.Tensor] | None = None


class Students:
    """The fine-tuned views of one run and what trains in each."""

    def __init__(self, pruned: PrunedModel, cfg: DistillConfig, methods: Mapping[str, str] | None = None) -> None:
        """`methods`: the registered method behind each recovery name (a run's ``{name: method}``); a name
        it does not hold is taken as the method's own name."""
        self.pruned = pruned
        self.cfg = cfg
        self.methods = dict(methods or {})
        self.specs: dict[str, Student] = {s.name: s for s in cfg.specs()}
        self.views = list(self.specs)
        self.params: dict[str, StudentParams] = {}
        self.named: dict[str, dict[str, nn.Parameter]] = {}
        # What a part keeps of its own between building and collecting its parameters (`Part.build`).
        self.state: dict[str, object] = {}
        # Per student, the first block whose input differs from the teacher's: 0 runs the whole forward.
        self.starts = {v: self._first_trained_block(s) for v, s in self.specs.items()}
        self.share_prefix = False
        # Per view, fixed once the students are built: its output head and the modules whose inputs are the
        # streams after the gaps (looked up once, not at every step).
        self._heads: dict[str, object] = {}
        self._sites: dict[str, list[nn.Module]] = {}
        self.cache: TeacherCache | None = None  # the teacher's cached top-k (`distill.teacher_topk`)
        self.bf16 = False  # the students' forward under bfloat16 autocast (`distill.precision`)

    def autocast(self):
        """Where a student's forward and loss run: bfloat16 autocast with `bf16`, else as they are."""
        if not self.bf16:
            return nullcontext()
        return torch.autocast(next(self.pruned.model.parameters()).device.type, dtype=torch.bfloat16)

    def _first_trained_block(self, spec: Student) -> int:
        plan = self.pruned.plan
        firsts = [get_part(kind).first_block(plan, spec) for kind in spec.train]
        return min([min(g.start for g in plan.gaps), *(b for b in firsts if b is not None)])

    def build(self) -> None:
        """Create every fine-tuned view from its method's fitted view, then each part it trains; freeze
        everything else."""
        pruned = self.pruned
        for frozen in (pruned.model, pruned.operators, pruned.mlp_maps):
            frozen.requires_grad_(False)
        for view, spec in self.specs.items():
            operators = {k: copy.deepcopy(op) for k, op in pruned.operators[spec.method].items()}
            mlp_maps = {k: copy.deepcopy(op) for k, op in pruned.mlp_maps[spec.method].items()}
            pruned.add_method(view, operators, mlp_maps)
        for kind in sorted(parts(), key=lambda k: get_part(k).build_last):
            views = [v for v, s in self.specs.items() if s.trains(kind)]
            if views:
                get_part(kind).build(self, views)
        self.refresh_params()
        self.share_prefix = self.cfg.share_prefix and any(i > 0 for i in self.starts.values())
        if not self.share_prefix:
            self.starts = dict.fromkeys(self.views, 0)
        for listener in pruned.listeners:
            listener(pruned.view)

    def refresh_params(self) -> None:
        """Collect each student's trainable parameters, part by part, by name, and mark them trainable. Run
        again after anything replaces parameter objects (FSDP2 sharding does)."""
        for view, spec in self.specs.items():
            by_part = {kind: get_part(kind).params(self, view, spec) for kind in parts()}
            self.named[view] = {name: p for params in by_part.values() for name, p in params.items()}
            self.params[view] = StudentParams({kind: list(params.values()) for kind, params in by_part.items()})
            for p in self.params[view].all():
                p.requires_grad_(True)

    def head(self, view: str):
        """hidden → logits of `view` (a `tail` student has its own head)."""
        if view not in self._heads:
            with self.pruned.use(view) as model:
                self._heads[view] = output_head(model)
        return self._heads[view]

    def _stream_sites(self, view: str) -> list[nn.Module]:
        if view not in self._sites:
            self._sites[view] = stream_sites(self.pruned, view)
        return self._sites[view]

    def _forward(
        self, view: str, batch, skip: int, embeds, taps: list[nn.Module], stop: bool = False
    ) -> tuple[torch.Tensor | None, list]:
        """The decoder of `view` on `batch` (from `embeds` entering block `skip` when given): its final hidden
        states and the input of each module of `taps`, captured by forward pre-hooks; with `stop`, the pass
        ends as soon as every tap has its input (no final hidden states: None)."""
        ids, mask = model_inputs(self.pruned.model, batch)
        inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        seen: list = [None] * len(taps)

        def grab(k: int, module, args, kwargs) -> None:
            seen[k] = args[0] if args else kwargs["hidden_states"]
            if stop and all(x is not None for x in seen):
                raise _Enough

        hooks = [m.register_forward_pre_hook(partial(grab, k), with_kwargs=True) for k, m in enumerate(taps)]
        try:
            with self.pruned.use(view, skip=skip) as m:
                out = decoder_of(m)(**inputs, attention_mask=mask, use_cache=False)
        except _Enough:
            return None, seen
        finally:
            for h in hooks:
                h.remove()
        return out.last_hidden_state, seen

    def teacher(self, batch: dict[str, torch.Tensor], logits: bool = True) -> TeacherPass:
        """One dense pass: final hidden states, the stream entering each student's start, and (with a
        hidden-state term) the stream after each gap. Without `logits` (they come from the cache) the pass
        stops once it has those streams, and does not run at all when none is needed."""
        starts = sorted({i for i in self.starts.values() if i > 0}) if self.share_prefix else []
        sites = self._stream_sites(DENSE) if any(s.loss.hidden_weight > 0 for s in self.specs.values()) else []
        taps = [*(self.pruned.dense_layers[i] for i in starts), *sites]
        if not logits and not taps:
            return TeacherPass(None, {})
        with torch.no_grad():
            hidden, seen = self._forward(DENSE, batch, 0, None, taps, stop=not logits)
        return TeacherPass(hidden, dict(zip(starts, seen)), seen[len(starts) :] or None)

    def student(self, view: str, batch: dict[str, torch.Tensor], teacher: TeacherPass | None = None) -> StudentPass:
        """A student's final hidden states (from the teacher's stream at its start when shared), and the
        streams after the gaps when its loss has a hidden-state term."""
        start = self.starts.get(view, 0)
        embeds = teacher.prefixes.get(start) if teacher is not None and start > 0 else None
        # Every block before a student's start survives (the start is at most its first gap), so the view
        # skips exactly `start` of its blocks.
        skip = start if embeds is not None else 0
        sites = self._stream_sites(view) if self.specs[view].loss.hidden_weight > 0 else []
        hidden, streams = self._forward(view, batch, skip, embeds, sites)
        return StudentPass(hidden, streams or None)

    @torch.no_grad()
    def check_prefix(self, batch: dict[str, torch.Tensor]) -> bool:
        """Use the shared prefixes only if they reproduce a student's full forward on this batch; returns
        whether they are on."""
        view = next((v for v, i in self.starts.items() if i > 0), None)
        if not self.share_prefix or view is None:
            return self.share_prefix
        full = self.student(view, batch, None).hidden
        short = self.student(view, batch, self.teacher(batch)).hidden
        tol = 1e-4 if full.dtype == torch.float32 else 2e-2
        if not torch.allclose(full.float(), short.float(), atol=tol, rtol=tol):
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"{type(self.pruned.model).__name__}: starting the students after the blocks before their first "
                "gap does not reproduce their full forward (the family transforms its input embeddings); "
                "running the full forward for every student instead"
            )
            self.share_prefix = False
            self.starts = dict.fromkeys(self.views, 0)
        return self.share_prefix

    def trainable_state(self, view: str) -> dict[str, torch.Tensor]:
        """A copy of a student's trainable values by parameter name (to keep its best step); sharded
        parameters keep their shard, so each rank copies only its part."""
        return {name: p.detach().clone() for name, p in self.named[view].items()}

    @torch.no_grad()
    def load_trainable_state(self, view: str, state: dict[str, torch.Tensor]) -> None:
        """Put saved values (`trainable_state`'s names) back into a student; the names must match exactly."""
        params = self.named[view]
        if set(state) != set(params):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise ValueError(
                f"{view}: the saved state does not hold this student's tensors (missing {missing[:3]}, "
                f"unexpected {extra[:3]}); it was saved with other distill settings"
            )
        for name, p in params.items():
            value = state[name]
            if value.dim() == 0 and tuple(p.shape) == (1,):
                value = value.reshape(1)  # a scale saved 0-dim, before FSDP2 needed it 1-D (ReparametrisedOperator)
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{view}: {name} has shape {tuple(value.shape)} saved, {tuple(p.shape)} here")
            if hasattr(p, "full_tensor") and not hasattr(value, "full_tensor"):
                # A whole tensor from a checkpoint into a sharded parameter: take this rank's part.
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)
            p.copy_(value.to(p.device, p.dtype) if not hasattr(value, "full_tensor") else value)
