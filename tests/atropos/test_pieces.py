"""``/batch`` bodies joined from pieces deflated at post time: one gzip member that every
client decodes whole, the same bytes as the uncompressed answer, an identical re-post
acknowledged without a second XADD, and empty optional lists kept as posted."""

from __future__ import annotations

import gzip
import zlib

import httpx
import pytest
import redis.asyncio as aioredis
import urllib3.response

from rollq.ops.atropos.pieces import compress, gzip_join, inflate, raw_join
from tests.atropos.helpers import REGISTRATION, api_client, atropos_group, marker_of

PARTS = [b'{"batch":[', b'{"a":' + b"1234567890" * 5000 + b"}", b",", b"", b'"\xc3\xa9"', b"]}"]


def _httpx_decode(body: bytes) -> bytes:
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"Content-Encoding": "gzip"})

    with httpx.Client(transport=httpx.MockTransport(reply)) as client:
        return client.get("http://x.test/").content


def _urllib3_decode(body: bytes) -> bytes:  # what `requests` (atroposlib's trainer) uses
    decoder = urllib3.response.GzipDecoder()
    return decoder.decompress(body) + decoder.flush()


def _single_member_decode(body: bytes) -> bytes:  # what aiohttp and httpx do: one member
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    return decompressor.decompress(body) + decompressor.flush()


@pytest.mark.parametrize("decode", [gzip.decompress, _httpx_decode, _urllib3_decode,
                                    _single_member_decode])
def test_joined_pieces_are_one_gzip_stream_every_client_decodes_whole(decode: object) -> None:
    pieces = [compress(part) for part in PARTS]
    assert decode(gzip_join(pieces)) == b"".join(PARTS)  # type: ignore[operator]
    assert decode(gzip_join([])) == b""  # type: ignore[operator]


def test_concatenated_gzip_members_would_be_cut_short_by_httpx() -> None:
    members = b"".join(gzip.compress(part) for part in PARTS)  # why pieces are joined
    assert gzip.decompress(members) == b"".join(PARTS)
    assert _httpx_decode(members) == PARTS[0]


def test_a_piece_inflates_to_its_bytes_and_levels_only_change_the_size() -> None:
    raw = PARTS[1]
    assert inflate(compress(raw, 1)) == inflate(compress(raw, 9)) == raw
    assert raw_join([compress(p) for p in PARTS]) == b"".join(PARTS)
    with pytest.raises(ValueError, match="header says"):
        inflate(compress(raw)[:-200])


async def test_gzip_and_identity_answers_carry_the_same_batch(redis: aioredis.Redis) -> None:
    async with api_client(redis) as client:
        await client.post("/register", json=REGISTRATION)
        await client.get("/batch")
        for marker in (1, 2):
            await client.post("/scored_data", json=atropos_group(marker, completion=300))
        zipped = await client.get("/batch", headers={"Accept-Encoding": "gzip"})
        await client.post("/register", json=REGISTRATION)  # a restarted trainer: same batch
        plain = await client.get("/batch", headers={"Accept-Encoding": "identity"})
        refused = await client.get("/batch", headers={"Accept-Encoding": "gzip;q=0"})
    assert zipped.headers["content-encoding"] == "gzip"
    assert "content-encoding" not in plain.headers
    assert zipped.content == plain.content  # httpx decoded the gzip one
    assert [marker_of(g) for g in plain.json()["batch"]] == [1, 2]
    assert "content-encoding" not in refused.headers
    assert refused.json()["batch"] is None  # acked the batch above; nothing else queued
    pieces = await redis.hlen("rollq:{atr:0}:atropos:pieces")
    assert pieces == 0  # dropped with the acked groups


@pytest.mark.parametrize(("window", "stored"), [(600, 1), (0, 2)])
async def test_an_identical_repost_is_acknowledged_once(redis: aioredis.Redis, window: int,
                                                        stored: int) -> None:
    group = atropos_group(1)
    async with api_client(redis, dedup_window_s=window) as client:
        for _ in range(2):  # atroposlib's env re-posts after a 5xx or a timeout
            response = await client.post("/scored_data", json=group)
            assert response.json() == {"status": "received"}
        other = {**group, "scores": [0.5, 0.25]}  # other scores: another group
        assert (await client.post("/scored_data", json=other)).status_code == 200
        assert await redis.xlen("rollq:{atr:0}:scored") == stored + 1
        assert (await client.get("/status")).json()["queue_size"] == stored + 1


async def test_empty_optional_lists_come_back_as_posted(redis: aioredis.Redis) -> None:
    server = pytest.importorskip("atroposlib.api.server")
    group = atropos_group(1, advantages=[], ref_logprobs=[], overrides=[], images=[],
                          messages=[], group_overrides={})  # atroposlib's default gathering
    async with api_client(redis) as client:
        await client.post("/register", json={**REGISTRATION, "batch_size": 2})
        await client.get("/batch")
        assert (await client.post("/scored_data", json=group)).status_code == 200
        batch = (await client.get("/batch")).json()["batch"]
    assert batch == [server.ScoredData.model_validate(group).model_dump()]


def test_the_process_piece_cache_keeps_the_newest_within_its_budget() -> None:
    from rollq.ops.atropos.kept_pieces import PieceCache

    cache = PieceCache(budget=10)
    for i in range(4):
        cache.put(("s", str(i)), b"x" * 4)
    assert [cache.get(("s", str(i))) for i in range(4)] == [None, None, b"xxxx", b"xxxx"]
    assert cache.size == 8
    cache.pop(("s", "3"))
    cache.put(("s", "2"), b"yy")  # replaced, not counted twice
    assert (cache.size, cache.get(("s", "2"))) == (2, b"yy")


async def test_posted_groups_are_read_into_the_queue_between_requests(
        redis: aioredis.Redis) -> None:
    import asyncio

    async with api_client(redis) as client:
        await client.post("/scored_data", json=atropos_group(1))
        for _ in range(500):  # the API's own reader takes it, with no request asking
            pending = await redis.xpending("rollq:{atr:0}:scored", "atropos")
            if pending["pending"] == 1:
                break
            await asyncio.sleep(0.01)
        assert pending["pending"] == 1
        assert (await client.get("/status")).json()["queue_size"] == 1
