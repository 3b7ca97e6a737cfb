"""The reader ops: what a worker asks of the daemon — a lease, heartbeats, the index, a refresh, derived tensors.

A component of the weight service over the lease table and the generations; none of these ops changes what is
served (they need the `read` permission only). Derived tensors (dtype casts and gathers) are made by `derived/requests`
(the service's, handed in) from the served bytes of a lease's generation.
"""

from __future__ import annotations

from expertd import messages, replies
from expertd.errors import GenerationGone, NotReady
from expertd.message_types import ABSENT

from ..derived.requests import DerivedRequests
from ..serving.dispatch import handles
from ..serving.generations import Generation, Generations
from ..serving.leases import LeaseTable, process_of, watchable
from ..serving.peers import Peer


class Readers:
    def __init__(self, cfg, leases: LeaseTable, gens: Generations, derived: DerivedRequests):
        self.cfg, self.leases, self.gens = cfg, leases, gens
        self.derived = derived  # casts and gathers: checked whole, counted, made off the loop

    @handles(messages.Lease)
    def op_lease(self, req: messages.Lease, peer: Peer) -> replies.LeaseReply:
        """A lease on the latest generation (or on live `generation`, resuming after a restart), counted against its
        holder (`Peer.holder`: the uid on ipc://, the CURVE key on tcp://); on ipc:// it names the pid the kernel
        vouches for, and a worker in the daemon's pid namespace is watched: its lease goes as soon as it does."""
        number = self.gens.leasable(req.generation)
        self.gens.check_pin(peer.account, number)
        claimed = peer.pid is None or peer.pid == req.pid  # on ipc:// the process that sent it, nothing else
        lease = self.leases.take(peer.pid or req.pid, number,
                                 start_time=watchable(req.pid, req.pid_ns, req.start_time) if claimed else None,
                                 owner=peer.holder, process=process_of(peer.pid), account=peer.account)
        gen = self.gens.generation_of(lease)
        # attach in one round trip: the worker maps and decodes the index itself (none while loading)
        return replies.LeaseReply(client=lease.client, lease_timeout_s=self.cfg.lease_timeout_s,
                                  generation=lease.generation,
                                  index_segment=gen.index_place if gen is not None else ABSENT)

    @handles(messages.Heartbeat)
    def op_heartbeat(self, req: messages.Heartbeat, peer: Peer) -> replies.HeartbeatReply:
        """Keep a lease the sender holds (anyone else's is answered as unknown: LeaseExpired)."""
        return replies.HeartbeatReply(generation=self.leases.beat(req.client, peer.holder).generation)

    @handles(messages.Release)
    def op_release(self, req: messages.Release, peer: Peer) -> replies.Done:
        if self.leases.release(req.client, peer.holder):
            self.gens.retire()
        return replies.Done()

    @handles(messages.Refresh)
    def op_refresh(self, req: messages.Refresh, peer: Peer) -> replies.IndexSegmentReply:
        """Move the lease to the latest generation (the one it leaves may retire); the reply names its index."""
        latest = self.gens.serving()
        lease = self.leases.beat(req.client, peer.holder)
        self.leases.move(lease, latest.number)
        self.gens.retire()
        return replies.IndexSegmentReply(generation=lease.generation, index_segment=latest.index_place)

    @handles(messages.Index)
    def op_index(self, req: messages.Index, peer: Peer) -> replies.IndexSegmentReply | replies.IndexReply:
        """The index of the generation the client's lease is on (the latest for a request without a lease):
        with `segment: true` only its index segment's descriptor (what a lease taken while loading asks
        for), else the index inline (for tools that ask over the socket)."""
        lease = self.leases.get(req.client, peer.holder) if req.client is not None else None
        gen = self.gens.generation_of(lease)
        if gen is None:
            raise NotReady("the daemon is still loading")
        if req.segment:
            return replies.IndexSegmentReply(generation=gen.number, index_segment=gen.index_place)
        return replies.IndexReply(index=gen.index_map())

    @handles(messages.Cast)
    def op_cast(self, req: messages.Cast, peer: Peer) -> replies.DerivedReply:
        """Dtype derived tensors of served tensors for a worker whose transformers loads them in another dtype: cast
        once per host into the lease's generation (or `generation`, which must be live), reused by every later ask;
        counted against the sender's quota (`derived`)."""
        return self.derived.ask("cast", self._generation(req, peer), req.tensors, peer, req.client)

    @handles(messages.Gather)
    def op_gather(self, req: messages.Gather, peer: Peer) -> replies.DerivedReply:
        """Served tensors rearranged into an engine's layout (`expertd.derived`), made once per host."""
        return self.derived.ask("gather", self._generation(req, peer), req.tensors, peer, req.client)

    def _generation(self, req: messages.DerivedRequest, peer: Peer) -> Generation:
        lease = self.leases.get(req.client, peer.holder)  # only the lease's holder may ask on it
        number = req.generation if req.generation is not None else self.gens.generation_of(lease).number
        gen = self.gens.live.get(number)
        if gen is None:
            raise GenerationGone(f"generation {number} is not served any more (live: {sorted(self.gens.live)}): its "
                                 "derived tensors went with it; refresh() and ask again")
        return gen
