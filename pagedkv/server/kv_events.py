"""KV cache events over ZMQ, in vLLM's wire format, so a KV-aware router knows what each replica holds.

vLLM workers publish ``KVEventBatch`` messages (``--kv-events-config``) and ``vllm-router
--policy kv_aware`` subscribes to them: it rebuilds each worker's prefix tree from the token ids
in ``BlockStored`` events and routes a request to the worker holding its longest prefix. This
module speaks the same protocol from pagedkv's real block pool:

* a ZMQ PUB socket bound to ``endpoint``; each message is three frames: topic, an 8-byte
  big-endian sequence number, and the msgpack payload;
* the payload is a msgpack array ``[ts, [event, ...], data_parallel_rank]``; each event is a map
  tagged by ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved`` (``block_hashes``,
  ``medium``) or ``AllBlocksCleared``. (vllm-router 0.1.17 reads events only as tagged maps.)
* the sequence number restarts at 0 with the process: the router takes a drop in it for a
  restarted worker and forgets what that worker held.

Block hashes are what vLLM's are: a chain over the parent's hash and the block's tokens
(:func:`pagedkv.memory.block_hash`: sha256, first 8 bytes as a non-negative int), so two
replicas that cache the same prefix announce the same hashes -- and a block keeps its hash when
it moves to a second KV tier, whose changes are published with the tier's medium (``CPU`` for
host RAM, ``DISK``) next to the pool's ``GPU``: a router sees which blocks a replica can load
rather than recompute. The pool calls the :class:`~pagedkv.memory.KVCacheListener` methods on
the engine thread, which only enqueue; a publisher thread hashes, batches and sends, so the
engine step never waits on a socket.

A salted request's blocks (``cache_salt``) hash under the salt's root, so their hashes differ
from an unsalted prefix's; their events keep vLLM's format: a first block's
``parent_block_hash`` is null, salted or not, as vLLM announces it (the salt itself is never
published). A LoRA adapter's blocks hash under a root of their own too (the prefix cache never
shares them across adapters), and their ``BlockStored`` events name the adapter (``lora_id``,
``lora_name``): the engine's ``lora_roots`` says which adapter a root is, and a block inherits
its parent's. A second tier's ``BlockStored`` events name it the same way: a block keeps the root
of its chain when it moves there (:class:`~pagedkv.memory.TierEvent` ``root``). An adapter's own
weights spilled to the tier are not KV blocks and announce nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import zmq

from pagedkv.config.checks import json_object
from pagedkv.engine import LoRARequest
from pagedkv.memory import POOL_MEDIUM, TierEvent, block_hash, is_root, root_hash

logger = logging.getLogger("pagedkv.server.kv_events")

#: The medium vLLM names for blocks held in the accelerator's KV cache (the pool).
MEDIUM = POOL_MEDIUM
_STOP = object()


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` JSON (the fields pagedkv uses; the others are accepted)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        raw = json_object("--kv-events-config", text)
        fields = {k: raw[k] for k in ("enable_kv_cache_events", "publisher", "endpoint", "topic") if k in raw}
        config = cls(**fields)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(
                f"--kv-events-config publisher must be 'zmq' or 'null', got {config.publisher!r}"
            )
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqKVEventPublisher:
    """A :class:`~pagedkv.memory.KVCacheListener` that publishes the pool's changes over ZMQ."""

    def __init__(
        self,
        config: KVEventsConfig,
        block_size: int,
        data_parallel_rank: int = 0,
        lora_roots: Mapping[int, LoRARequest] | None = None,
    ) -> None:
        self.block_size = block_size
        #: prefix root -> the adapter whose blocks hash under it (the engine's ``lora_roots``)
        self.lora_roots = {} if lora_roots is None else lora_roots
        self._lora_of: dict[int, LoRARequest] = {}  # cached block id -> its adapter
        self.topic = config.topic.encode()
        self.data_parallel_rank = data_parallel_rank
        # NOTE: the process-wide context, never terminated: a Context() of our own that the
        # garbage collector finalizes while one of its sockets is still open blocks in term()
        # forever (seen: a test process hung in Context.__del__). Sockets are closed explicitly.
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(config.endpoint)
        except zmq.ZMQError:
            self._socket.close()
            raise
        self.endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._hash_of: dict[int, int] = {}  # cached block id -> its announced hash
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    # -- KVCacheListener (engine thread: enqueue only) ----------------------------------------
    def block_stored(self, block_id: int, parent: int, token_ids: Sequence[int]) -> None:
        self._queue.put(("stored", block_id, parent, tuple(token_ids)))

    def blocks_removed(self, block_ids: Sequence[int]) -> None:
        self._queue.put(("removed", tuple(block_ids)))

    def all_blocks_cleared(self) -> None:
        self._queue.put(("cleared",))

    def tier_changed(self, events: Sequence[TierEvent]) -> None:
        self._queue.put(("tier", tuple(events)))

    # -- publisher thread ---------------------------------------------------------------------
    def _events(self, item: tuple) -> list[dict]:
        if item[0] != "tier":
            event = self._event(item)
            return [] if event is None else [event]
        return [_tier_event(change, self.block_size, self.lora_roots) for change in item[1]]

    def _event(self, item: tuple) -> dict | None:
        kind = item[0]
        if kind == "stored":
            _, block_id, parent, tokens = item
            parent_hash = root_hash(parent) if is_root(parent) else self._hash_of.get(parent)
            if not is_root(parent) and parent_hash is None:
                logger.warning("block %d stored under unannounced parent %d: not published", block_id, parent)
                return None
            digest = block_hash(parent_hash, tokens)
            self._hash_of[block_id] = digest
            lora = self.lora_roots.get(parent) if is_root(parent) else self._lora_of.get(parent)
            if lora is not None:
                self._lora_of[block_id] = lora
            return {
                "type": "BlockStored",
                "block_hashes": [digest],
                "parent_block_hash": _announced_parent(parent_hash),
                "token_ids": list(tokens),
                "block_size": self.block_size,
                "lora_id": None if lora is None else lora.lora_int_id,
                "medium": MEDIUM,
                "lora_name": None if lora is None else lora.lora_name,
            }
        if kind == "removed":
            for block_id in item[1]:
                self._lora_of.pop(block_id, None)
            hashes = [self._hash_of.pop(b) for b in item[1] if b in self._hash_of]
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM} if hashes else None
        self._hash_of.clear()
        self._lora_of.clear()
        return {"type": "AllBlocksCleared"}

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            events = []
            for item in items:
                if item is _STOP:
                    stopping = True
                    break
                events += self._events(item)
            if events:
                self._send(events)

    def _send(self, events: list[dict]) -> None:
        payload = msgpack.packb([time.time(), events, self.data_parallel_rank])
        self._socket.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        """Send what is queued, then close the socket (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=10)
        self._socket.close()


def _tier_event(change: TierEvent, block_size: int, lora_roots: Mapping[int, LoRARequest]) -> dict:
    """A second tier's change as vLLM's event, with the tier's medium (and the adapter whose
    request made the block, named by its chain's root)."""
    if change.removed:
        return {"type": "BlockRemoved", "block_hashes": list(change.block_hashes), "medium": change.medium}
    lora = None if change.root is None else lora_roots.get(change.root)
    return {
        "type": "BlockStored",
        "block_hashes": list(change.block_hashes),
        "parent_block_hash": _announced_parent(change.parent_hash),
        "token_ids": list(change.token_ids),
        "block_size": block_size,
        "lora_id": None if lora is None else lora.lora_int_id,
        "medium": change.medium,
        "lora_name": None if lora is None else lora.lora_name,
    }


def _announced_parent(parent_hash: int | None) -> int | None:
    """The ``parent_block_hash`` published: a block's hash, or null for a first block (a salted
    first block's parent is its salt's root, a negative int that names no block)."""
    return None if parent_hash is None or parent_hash < 0 else parent_hash
