"""The learner's calls that change the hub's state in Redis, retried after a lost reply.

A Redis restart (or a stall past the socket timeout) can lose a command's reply after the command
ran, and ``BatchClient`` retries (as redis-py does on its own): a claim retried must not pop a
second batch, a batch counted as finished must not count twice. Real Redis; only the reply is
lost, by raising ``ConnectionError`` after the real call returned, as a dropped connection would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from flywheel.hub_client import BatchClient
from flywheel.redis_server import RedisServer
from flywheel.staleness import StalenessPolicy
from flywheel.store import META, GroupMeta, dropped_entry, pack

RUN = "flywheel"


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[BatchClient]:
    c = BatchClient(redis_server.client(), RUN, StalenessPolicy(4, 2), redis_outage_s=10)
    yield c
    c.redis.close()


def ready(client: BatchClient, *gids: int, version: int = 0) -> None:
    """Groups scored and waiting, with data under their keys (a record without samples: the
    claim's path, not the samples' decoding, is what these tests are about)."""
    for gid in gids:
        meta = GroupMeta(
            group_id=gid, prompt_index=gid, epoch=0, prompt_tokens=b"", n_samples=0, metadata={}, issued_at_version=0
        )
        client.redis.hset(client.keys.group(gid), META, pack(meta))
        client.redis.zadd(client.keys.ready, {str(gid): version})


def lose_first_reply(client: BatchClient, call: str) -> list[int]:
    """The next ``call`` on the client's connection runs in Redis, then its reply is lost."""
    real: Callable[..., Any] = getattr(client.redis, call)
    lost: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if not lost:
            lost.append(1)
            raise redis.ConnectionError("reply lost (test)")
        return out

    setattr(client.redis, call, flaky)
    return lost


def counters(client: BatchClient) -> dict[str, int]:
    return {k: v for k, v in client.counters().items() if k.startswith("groups_")}


def test_a_claim_retried_after_its_reply_was_lost_returns_the_same_groups(client: BatchClient) -> None:
    ready(client, 1, 2, 3, 4)
    lost = lose_first_reply(client, "evalsha")
    batch = client.claim(2, 0, timeout_s=5)
    assert lost == [1]  # the first claim ran, and its reply was lost
    assert [g.group_id for g in batch.groups] == [1, 2]
    assert counters(client)["groups_consumed"] == 2  # not 4: no second batch was popped
    assert client.redis.zrange(client.keys.ready, 0, -1) == [b"3", b"4"]
    assert not client.redis.keys(client.keys.claim_receipt("*"))
    # read: the samples are removed, the prompt kept (and the groups held) until trained on
    for gid in (1, 2):
        assert client.redis.hkeys(client.keys.group(gid)) == [META]
    assert client.redis.smembers(client.keys.claimed("0")) == {b"1", b"2"}
    client.note_finished([1, 2])
    assert client.redis.exists(client.keys.group(1), client.keys.group(2)) == 0
    assert client.redis.smembers(client.keys.claimed("0")) == set()


def test_a_batch_counted_as_finished_counts_once_however_often_it_is_retried(client: BatchClient) -> None:
    lost = lose_first_reply(client, "evalsha")
    client.note_finished([1, 2], trained=False)
    assert lost == [1]
    assert counters(client) == {"groups_finished": 2, "groups_dropped": 2, "groups_filtered_out": 2}
    client.note_finished([3, 4, 5])  # another batch: counted
    assert counters(client)["groups_finished"] == 5


def test_a_learner_killed_before_training_on_its_claims_hands_them_to_the_hub(
    client: BatchClient, redis_server: RedisServer
) -> None:
    """Killed with one batch read and one claimed but not read (the claim made ahead): both go
    on the list the hub cleans up, which re-queues their prompts (``Hub._reap_dropped``). Before,
    the prompts of the batch read went with its data: lost for the epoch."""
    ready(client, 1, 2, 3, 4, 5)
    client.claim(2, 0, timeout_s=5)  # read, not trained on
    pairs, _ = client.try_claim(2, 1)  # claimed ahead; the learner dies before reading them
    assert sorted(gid for gid, _ in pairs) == [3, 4]
    other_rank = BatchClient(redis_server.client(), RUN, StalenessPolicy(4, 2), owner="1")
    assert other_rank.release_claimed() == 0  # another rank's claims are not its own
    restarted = BatchClient(redis_server.client(), RUN, StalenessPolicy(4, 2))  # the same rank, again
    assert restarted.release_claimed() == 4
    entries = [dropped_entry(e) for e in client.redis.lrange(client.keys.dropped, 0, -1)]
    assert sorted(entries) == [(g, True) for g in (1, 2, 3, 4)]  # marked: not dropped as too stale
    for gid in (1, 2, 3, 4):  # each with its prompt, for the hub to issue again
        assert client.redis.hget(client.keys.group(gid), META) is not None
    assert client.redis.zrange(client.keys.ready, 0, -1) == [b"5"]  # still ready, untouched
    assert client.redis.smembers(client.keys.claimed("0")) == set()
    assert restarted.release_claimed() == 0, "handed back once"
    assert restarted.release_untrained() == 4  # and admission gets them back, as before


def test_the_claims_of_ranks_a_smaller_restart_no_longer_has_are_handed_back(
    client: BatchClient, redis_server: RedisServer
) -> None:
    """Four ranks claimed, the learner restarts with two: each rank hands back its own claims,
    and rank 0 those of ranks 2 and 3, which no rank would otherwise ever take."""
    ready(client, *range(1, 9))
    for rank in range(4):
        BatchClient(redis_server.client(), RUN, StalenessPolicy(4, 2), owner=str(rank)).try_claim(2, 0)
    assert client.release_claimed_of_ranks_gone(2) == 4
    handed_back = sorted(dropped_entry(e) for e in client.redis.lrange(client.keys.dropped, 0, -1))
    assert handed_back == [(g, True) for g in (5, 6, 7, 8)]  # ranks 2 and 3 claimed after ranks 0 and 1
    assert client.redis.scard(client.keys.claimed("1")) == 2  # rank 1 is still there: its own to hand back
    assert client.redis.exists(client.keys.claimed("2"), client.keys.claimed("3")) == 0


def test_a_claim_of_thousands_of_groups_is_whole_and_a_refused_one_pops_nothing(client: BatchClient) -> None:
    """The claim script checked and recorded after its pop: `SADD claimed unpack(ids)` fails past
    ~8000 ids ("too many results to unpack") and the already-consumed guard after ZPOPMIN, and
    Redis does not roll a script back, so the popped groups were consumed and held by no one."""
    r = client.redis
    n = 10_000
    r.zadd(client.keys.ready, {str(gid): 0 for gid in range(n)})
    pairs, _ = client.try_claim(n, 0)
    assert len(pairs) == n and r.scard(client._claimed) == n and r.zcard(client.keys.ready) == 0
    r.zadd(client.keys.ready, {str(n): 0, "5": 0})  # group 5 comes back, though consumed
    with pytest.raises(redis.ResponseError, match="group 5 was already consumed"):
        client.try_claim(2, 0)
    assert r.zcard(client.keys.ready) == 2 and not r.getbit(client.keys.consumed, n)  # nothing popped
