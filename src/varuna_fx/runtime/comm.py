"""Communication with deadlines: point-to-point boundary traffic and bucketed all-reduce.

Every wait goes through :func:`wait`, which gives up after the timeout and raises
:class:`PeerTimeoutError` naming this rank, the peer and what was awaited; a peer that crashed
(the transport reports a closed connection) raises the same error at once. Nothing carries
metadata: shapes and dtypes come from the plan, and messages are matched by tag (gloo) and by
posting order, which both sides derive from the same schedule (NCCL matches by order only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerTimeoutError
from ..world.where import TIMEOUT_ENV
from .compress import decode, wire_spec
from .traffic import SENT

BUCKET_BYTES = 25 * 2**20  # all-reduce bucket size, as DDP


def wait(work: Any, timeout: float, who: str, what: str | Callable[[], str]) -> None:
    """``work.wait`` with a deadline; failures become :class:`PeerTimeoutError`.

    ``who`` is this rank ("stage 1 (rank 1)"), ``what`` what it waits for (a string or a
    function making one, so the common path builds no string)."""
    start = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError)
        raise peer_error(exc, time.monotonic() - start, who, what) from exc


def launch(start: Callable[[], Any], who: str, what: str | Callable[[], str]) -> Any:
    """Start a communication; a transport already broken by a lost peer raises right here."""
    try:
        return start()
    except RuntimeError as exc:
        text = what() if callable(what) else what
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PeerTimeoutError(
            f"{who} could not start {text}: the connection to its peers is broken (a peer "
            "crashed or exited, or an earlier wait timed out, which leaves the process group "
            "unusable). A longer timeout will not help: restart the job (under "
            f"'varuna-fx run --elastic' the agents restart the workers) ({detail})") from exc


def peer_error(exc: BaseException, waited: float, who: str,
               what: str | Callable[[], str]) -> PeerTimeoutError:
    text = what() if callable(what) else what
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "closed" in detail.lower() or "reset" in detail.lower():
        return PeerTimeoutError(
            f"{who} lost the connection after {waited:.1f} s while waiting for {text}: that "
            f"peer probably crashed or exited; see its log ({detail})"
        )
    return PeerTimeoutError(
        f"{who} waited {waited:.1f} s for {text} and gave up: the peer is stuck, slow or gone. "
        f"Raise the limit with vf.compile(..., timeout=seconds) or ${TIMEOUT_ENV} if it is "
        f"just slow ({detail})"
    )


@dataclass(frozen=True)
class Message:
    """One boundary tensor of one micro-batch, as both ends know it from the plan."""

    kind: str  # "activation" (downstream) or "gradient" (upstream)
    name: str  # the value's node name
    peer_stage: int
    peer_rank: int
    mb: int
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: Any = field(default=None, compare=False, repr=False)  # None: the default group
    # the stage on this rank that sends or receives it (a rank may run several stages, and two
    # of them may receive one value from one peer)
    stage: int = -1
    # how it travels (``compress.py``): "off", "bf16" or "int8"; shape and dtype stay the
    # value's own, the wire's are ``wire_spec``'s
    mode: str = "off"

    @property
    def key(self) -> tuple[str, str, int, int, int]:
        return self.kind, self.name, self.peer_stage, self.mb, self.stage

    def describe(self, direction: str = "from") -> str:
        return (f"the {self.kind} {self.name!r} of micro-batch {self.mb} {direction} stage "
                f"{self.peer_stage} (rank {self.peer_rank})")


class Inbox:
    """Receives posted ahead of use: :meth:`post` posts one where the lowered program's RECV op
    says; (evaluation) ``expected`` lists (action index, message) in the order this rank
    consumes them and :meth:`post_until` posts those needed before an action."""

    def __init__(self, expected: list[tuple[int, Message]], device: torch.device,
                 timeout: float, who: str) -> None:
        self._expected = expected
        self._next = 0
        self._posted: dict[tuple, tuple[Any, torch.Tensor, Message]] = {}
        self.device, self.timeout, self.who = device, timeout, who

    def post_until(self, action_index: int) -> None:
        """Post every receive needed by actions before ``action_index``."""
        while self._next < len(self._expected) and \
                self._expected[self._next][0] < action_index:
            self.post(self._expected[self._next][1])
            self._next += 1

    def post(self, msg: Message) -> None:
        """Post the receive of ``msg`` now (the lowered program says when: its RECV op)."""
        shape, dtype = wire_spec(msg.shape, msg.dtype, msg.mode)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        work = launch(
            lambda b=buffer, m=msg: dist.irecv(b, src=m.peer_rank, tag=m.tag, group=m.group),
            self.who, msg.describe)
        self._posted[msg.key] = (work, buffer, msg)

    def posted(self, key: tuple) -> bool:
        return key in self._posted

    def completed(self, key: tuple) -> bool:
        """Whether the posted receive ``key`` has landed, without waiting. Meaningful on NCCL
        (the receive's CUDA event has fired); a gloo receive never reports completion."""
        return bool(self._posted[key][0].is_completed())

    def take(self, key: tuple) -> torch.Tensor:
        """The received value (decoded from its wire form)."""
        work, buffer, msg = self._posted.pop(key)
        wait(work, self.timeout, self.who, msg.describe)
        return decode(buffer, msg.shape, msg.dtype, msg.mode)

    @property
    def pending(self) -> int:
        return len(self._posted) + len(self._expected) - self._next


class Outbox:
    """Sends in flight. Each is released (waited for, which then returns at once, and its
    tensor dropped) when a later message proves the peer received it (see ``acks.py``); the
    rest are waited for by :meth:`drain` at the end of the step. No helper thread: a thread
    waiting on sends contends for the GIL with the compute loop and made every send and
    receive call several times slower."""

    def __init__(self, timeout: float, who: str) -> None:
        self.timeout, self.who = timeout, who
        self._by_proof: dict[tuple, list[tuple[Any, torch.Tensor, Message]]] = {}
        self._at_end: list[tuple[Any, torch.Tensor, Message]] = []

    def send(self, tensor: torch.Tensor, msg: Message, proof: tuple | None = None) -> None:
        work = launch(
            lambda: dist.isend(tensor, dst=msg.peer_rank, tag=msg.tag, group=msg.group),
            self.who, lambda: msg.describe("to") + " to be received")
        SENT.send(tensor)
        pending = self._at_end if proof is None else self._by_proof.setdefault(proof, [])
        pending.append((work, tensor, msg))

    def release(self, proof: tuple) -> None:
        """``proof`` (a received message's key) arrived: the sends it vouches for are done."""
        for work, _tensor, msg in self._by_proof.pop(proof, ()):
            self._wait(work, msg)

    def drain(self) -> None:
        pending = [p for group in self._by_proof.values() for p in group] + self._at_end
        self._by_proof, self._at_end = {}, []
        for work, _tensor, msg in pending:
            self._wait(work, msg)

    def _wait(self, work: Any, msg: Message) -> None:
        wait(work, self.timeout, self.who, lambda: msg.describe("to") + " to be received")

    def close(self) -> None:
        self._by_proof, self._at_end = {}, []


class AllReduce:
    """Bucketed asynchronous all-reduce of gradients (flattened into ~25 MB buffers per dtype);
    :meth:`finish` waits, divides by ``divide`` and copies the results back."""

    def __init__(self, tensors: list[torch.Tensor], group: Any, *, divide: int,
                 timeout: float, who: str, what: str,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.divide, self.timeout, self.who, self.what = divide, timeout, who, what
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        for bucket in _buckets(tensors, bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 \
                else bucket[0].reshape(-1).clone()
            work = launch(lambda f=flat: dist.all_reduce(f, group=group, async_op=True), who,
                          what)
            SENT.all_reduce(flat, group)
            self._pending.append((work, flat, bucket))

    def finish(self) -> None:
        for work, flat, bucket in self._pending:
            wait(work, self.timeout, self.who, self.what)
            if self.divide != 1:
                flat.div_(self.divide)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self._pending.clear()


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to ``limit`` bytes per bucket."""
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    done: list[list[torch.Tensor]] = []
    for t in tensors:
        key = (t.dtype, t.device)
        bucket, size = open_.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            done.append(bucket)
            bucket, size = [], 0
        bucket.append(t)
        open_[key] = (bucket, size + nbytes)
    return done + [b for b, _ in open_.values() if b]
