"""Admission by memory's eviction rule, on its own (the executor test in test_executor_degraded runs it
for real): which idle sessions a new session may cost, and when it costs none."""
from types import SimpleNamespace

from toolrl.executor.forkserver.memory_admission import NEW_SESSION_BYTES, Held, MemoryAdmission

MB = 1 << 20


def admission(holding: dict[int, tuple[str, int]]) -> tuple[MemoryAdmission, list[int]]:
    """Share: 100 MB total - 1 worker x 20 MB = 80 MB. `holding`: index -> (state, MB held); the
    sessions are used least recently in index order."""
    sessions = {i: SimpleNamespace(state=state, proc=object(), kill_note=None) for i, (state, _) in holding.items()}
    evicted: list[int] = []
    a = MemoryAdmission(total=100 * MB, workers=1, default_bytes=20 * MB, sessions=sessions,
                        evict=lambda idx, note: evicted.append(idx), waiting=lambda: set(),
                        known_pids=lambda: set(), session_uid0=None)
    for i, (_, mb) in holding.items():
        a.held[i] = h = Held(float(i))
        h.bytes = mb * MB
        a.sum += h.bytes
    return a, evicted


def test_a_new_session_that_cannot_fit_is_refused_without_evicting_anyone():
    """An executing session holds 70 MB, an idle one 5: even with the idle one gone, 70 + 16 MB for a
    new session is over the 80 MB share. The new session is refused and the idle one keeps its state:
    evicting it would have cost its state for nothing."""
    a, evicted = admission({0: ("running", 70), 1: ("idle", 5)})
    why = a.admit(2)
    assert why is not None and "every session holding it is executing" in why
    assert evicted == [] and sorted(a.held) == [0, 1] and a.sum == 75 * MB
    assert (a.refused, a.evicted) == (1, 0)


def test_a_new_session_evicts_the_least_recently_used_idle_ones_it_needs_and_no_more():
    """Executing 40 MB, idle 15 + 15 + 5 (in that order of last use): 75 + 16 is over 80, and dropping
    the least recently used idle session (15 MB) is enough; the others keep their state."""
    a, evicted = admission({0: ("running", 40), 1: ("idle", 15), 2: ("idle", 15), 3: ("idle", 5)})
    assert a.admit(4) is None
    assert evicted == [1] and sorted(a.held) == [0, 2, 3, 4]
    assert a.sum == (40 + 15 + 5) * MB + NEW_SESSION_BYTES <= a.share()
    assert (a.refused, a.evicted) == (0, 1)


def test_a_session_with_a_block_queued_is_not_evicted():
    """Idle between blocks but with its next block queued, it is about to run: the least recently used
    session (40 MB) is passed over and the next idle one (30 MB) goes instead."""
    a, evicted = admission({0: ("idle", 40), 1: ("idle", 30)})
    a.waiting = lambda: {0}
    assert a.admit(2) is None and evicted == [1] and sorted(a.held) == [0, 2]
