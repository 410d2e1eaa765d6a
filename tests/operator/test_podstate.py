"""What the operator reads from a pod's status (as kubelets write it) and a node's Ready condition."""
import datetime as dt

from cpuserve_operator.podstate import node_lost_for, pod_problem


def pod(phase="Running", containers=(), conditions=(), **status):
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "containerStatuses": list(containers),
                                                  "conditions": list(conditions), **status}}


def engine(state, last=None, ready=False, restarts=0):
    return {"name": "engine", "state": state, "lastState": last or {}, "ready": ready, "restartCount": restarts}


def test_progress_is_no_problem():
    assert pod_problem(pod("Pending", [engine({"waiting": {"reason": "ContainerCreating"}})])) is None
    assert pod_problem(pod("Running", [engine({"running": {}}, ready=True)])) is None
    assert pod_problem(pod("Pending")) is None


def test_rejection_is_fatal_with_the_kubelets_words():
    p = pod_problem(pod("Failed", reason="OutOfcpu", message="Node didn't have enough resource: cpu"))
    assert (p.reason, p.fatal) == ("OutOfcpu", True) and "enough resource" in p.message


def test_image_pull_back_off():
    p = pod_problem(pod("Pending", [engine({"waiting": {"reason": "ImagePullBackOff",
                                                        "message": 'Back-off pulling image "x:1"'}})]))
    assert (p.reason, p.fatal) == ("ImagePullBackOff", False) and 'pulling image "x:1"' in p.message


def test_crash_loop_says_why_the_last_run_ended():
    p = pod_problem(pod(containers=[engine({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                                           {"terminated": {"reason": "Error", "exitCode": 2,
                                                           "message": "trace\nValueError: bad model"}}, restarts=3)]))
    assert p.reason == "CrashLoopBackOff"
    assert p.message.startswith("last run: Error (exit 2): ValueError: bad model") and "back-off 40s" in p.message


def test_oom_kill_now_and_before():
    now = pod_problem(pod(containers=[engine({"terminated": {"reason": "OOMKilled", "exitCode": 137}})]))
    assert now.reason == "OOMKilled" and "exit 137" in now.message and "sizeGiB" in now.message
    restarted = pod_problem(pod(containers=[engine({"running": {}}, {"terminated": {"reason": "OOMKilled",
                                                                                    "exitCode": 137}}, restarts=1)]))
    assert restarted.reason == "OOMKilled" and "restarted 1 time" in restarted.message
    recovered = pod(containers=[engine({"running": {}}, {"terminated": {"reason": "OOMKilled"}}, ready=True)])
    assert pod_problem(recovered) is None


def test_unschedulable():
    p = pod_problem(pod("Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                "message": "0/3 nodes are available"}]))
    assert p.reason == "Unschedulable" and not p.fatal


def node(status, since):
    return {"status": {"conditions": [{"type": "Ready", "status": status, "lastTransitionTime": since}]}}


def test_node_lost_for():
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    stamp = t0.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert node_lost_for(node("True", stamp), t0.timestamp() + 1000) == 0
    assert node_lost_for(node("Unknown", stamp), t0.timestamp() + 42) == 42
    assert node_lost_for(node("False", stamp), t0.timestamp() - 5) == 0  # clocks apart: never negative
    assert node_lost_for(None, 0) == float("inf")
    assert node_lost_for({"status": {}}, 1e9) == 0  # no condition yet (a node registering)
    assert node_lost_for(node("False", "2026-01-01T00:00:00+00:00"), t0.timestamp() + 7) == 7  # the client's form


def test_model_too_large_for_its_limit_is_named_as_such():
    """The engine refuses a model its memory limit cannot hold (not an OOM kill); its last log
    line, the termination message, becomes the reason."""
    msg = ("Traceback ...\nRuntimeError: engine core failed to start: MemoryError: ModelTooLarge: the weights "
           "(6.00 GiB as bfloat16) and the KV cache (4.00 GiB), on top of the 0.30 GiB in use, need 10.30 GiB, "
           "more than this container's memory limit of 6.00 GiB. Raise the limit ...")
    p = pod_problem(pod(containers=[engine({"waiting": {"reason": "CrashLoopBackOff"}},
                                           {"terminated": {"reason": "Error", "exitCode": 1, "message": msg}})]))
    assert p.reason == "ModelTooLarge" and p.message.startswith("the weights (6.00 GiB as bfloat16)")
    assert "memory limit of 6.00 GiB" in p.message and not p.fatal
