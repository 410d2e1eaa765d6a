"""What is wrong with a pod, as the kubelet reports it: pure functions of the pod (the API's
JSON form), so that status, Events and metrics all say the same thing.

A problem is *fatal* when the pod will never serve and must be replaced (the kubelet
rejected or evicted it: phase Failed), and *transient* when the kubelet keeps retrying
(image pull back-off, crash loop, OOM kill) and the operator reports but waits."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

# waiting reasons that mean "not progressing" (ContainerCreating and PodInitializing are progress)
# the engine's word for a model that cannot fit the container's memory limit (kv_cache.TOO_LARGE):
# it reaches the pod's status through terminationMessagePolicy FallbackToLogsOnError
TOO_LARGE = "ModelTooLarge"
STUCK_WAITING = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull", "CrashLoopBackOff",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "PreCreateHookError")


@dataclass(frozen=True)
class Problem:
    reason: str      # the kubelet's word: ImagePullBackOff, CrashLoopBackOff, OOMKilled, OutOfcpu, ...
    message: str
    fatal: bool = False

    def describe(self, pod: str) -> str:
        return f"pod {pod}: {self.reason}" + (f": {self.message}" if self.message else "")


def _terminated(t: dict) -> str:
    """`OOMKilled (exit 137)`, `Error (exit 1): <message>`."""
    text = f"{t.get('reason') or 'Terminated'} (exit {t.get('exitCode', '?')})"
    msg = (t.get("message") or "").strip().splitlines()
    return text + (f": {msg[-1][:300]}" if msg else "")


def pod_problem(pod: dict) -> Problem | None:
    """The first thing keeping this pod from serving, or None while it is fine or progressing."""
    st = pod.get("status") or {}
    if st.get("phase") == "Failed":
        return Problem(st.get("reason") or "Failed", (st.get("message") or "").strip(), fatal=True)
    for c in st.get("containerStatuses") or []:
        state, last = c.get("state") or {}, c.get("lastState") or {}
        waiting, term = state.get("waiting"), state.get("terminated")
        ended = term or last.get("terminated") or {}
        if TOO_LARGE in (ended.get("message") or ""):  # the engine refused before an OOM kill
            text = ended["message"][ended["message"].index(TOO_LARGE) + len(TOO_LARGE):].lstrip(": ").splitlines()[0]
            return Problem(TOO_LARGE, text[:600])
        if waiting and waiting.get("reason") in STUCK_WAITING:
            msg = (waiting.get("message") or "").strip()
            if last.get("terminated"):  # a crash loop: why the last run ended is what the user needs
                msg = f"last run: {_terminated(last['terminated'])}" + (f"; {msg}" if msg else "")
            return Problem(waiting["reason"], msg)
        if term and term.get("reason") == "OOMKilled":
            return Problem("OOMKilled", f"container {c.get('name')}: {_terminated(term)}; raise spec.engine.memoryGiB "
                                        "(or declare the model's real size in spec.model.sizeGiB)")
        if not c.get("ready") and (last.get("terminated") or {}).get("reason") == "OOMKilled":
            return Problem("OOMKilled", f"container {c.get('name')} restarted {c.get('restartCount', 0)} time(s), "
                                        f"last: {_terminated(last['terminated'])}")
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason"):
            return Problem(cond["reason"], (cond.get("message") or "").strip())
    return None


def _parse_time(s: str | None) -> float | None:
    if not s:
        return None
    t = dt.datetime.fromisoformat(str(s).replace("Z", "+00:00"))  # the API's form, or the client's isoformat
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def node_lost_for(node: dict | None, now: float) -> float:
    """Seconds the node has been gone or not Ready (0 while Ready; inf when it is gone)."""
    if node is None:
        return float("inf")
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") == "True":
        return 0.0
    since = _parse_time(ready.get("lastTransitionTime"))
    return max(0.0, now - since) if since is not None else 0.0
