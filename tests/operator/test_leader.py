"""Leader election's rule, pure (client-go's: expiry by the candidate's own clock)."""
from cpuserve_operator.leader import Observed, decide


def lease(holder, renew="2026-01-01T00:00:00.000000Z"):
    return {"metadata": {"resourceVersion": "1"}, "spec": {"holderIdentity": holder, "renewTime": renew}}


def test_no_lease_is_created_and_our_own_is_renewed():
    assert decide(None, "a", None, 0, 15) == "create"
    assert decide(lease("a"), "a", None, 0, 15) == "renew"


def test_released_lease_is_taken_at_once():
    assert decide(lease(""), "b", None, 0, 15) == "acquire"


def test_a_holder_is_alive_while_its_record_changes():
    seen = Observed("a", "2026-01-01T00:00:00.000000Z", at=100)
    assert decide(lease("a"), "b", None, 1000, 15) == "wait"             # first look: no opinion yet
    assert decide(lease("a"), "b", seen, 110, 15) == "wait"              # unchanged for 10 s < 15
    assert decide(lease("a"), "b", seen, 115, 15) == "acquire"           # unchanged for 15 s: expired
    assert decide(lease("a", "2026-01-01T00:00:09.000000Z"), "b", seen, 500, 15) == "wait"  # renewed
    assert decide(lease("c"), "b", seen, 500, 15) == "wait"              # a new holder
