"""Request ids and the engines' abort-by-prefix: aborting one response's rid must not abort another
(`megatron_rl.rollout.manager.request_id`; SGLang's `/abort_request` matches rids by prefix)."""

from megatron_rl.rollout.manager import request_id


def test_no_rid_of_a_batch_is_a_prefix_of_another():
    for n in (1, 2, 8, 10, 16, 100):
        rids = [request_id("s3-b0", i, j, n) for i in range(12) for j in range(n)]
        assert len(set(rids)) == len(rids)
        hits = {a: [b for b in rids if b.startswith(a)] for a in rids}
        assert all(h == [a] for a, h in hits.items()), n


def test_padding_and_the_batch_prefix():
    assert request_id("s1-b0", 0, 0, 8) == "s1-b0-p0-r0"
    assert request_id("s1-b0", 3, 1, 16) == "s1-b0-p3-r01"   # unpadded "-r1" would also match "-r10".."-r15"
    assert request_id("s1-b0", 3, 15, 16) == "s1-b0-p3-r15"
    assert request_id("s1-b0", 0, 7, 101) == "s1-b0-p0-r007"
    assert request_id("s12-b1", 0, 0, 16).startswith("s12-b1-")  # the manager's batch abort prefix "{tag}-"
