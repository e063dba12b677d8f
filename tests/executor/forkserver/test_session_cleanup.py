"""A session's index is freed only once its lane is empty: a lane the sweeps could not empty keeps the
index out of use and is swept again, as a slot goes down. (No real process survives SIGKILL on demand,
so the fork server's scheduling is driven here by hand: its own methods on a minimal host.)"""
from types import SimpleNamespace

from toolrl.executor.forkserver.manager import ForkServer
from toolrl.executor.forkserver.records import Session
from toolrl.executor.forkserver.session_runners import SessionRunners


class Host(SessionRunners):
    ensure_empty = ForkServer.ensure_empty
    on_sweeper = ForkServer.on_sweeper

    def __init__(self, sweep_answers):
        self.sessions, self.lost, self.memory, self.cgroups = {}, {}, None, None
        self.timers, self.delays, self.sweeps, self.destroyed, self.started = [], [], {}, [], []
        self.answers = list(sweep_answers)  # what the sweeper replies, in turn
        self.sweeper = SimpleNamespace(request=lambda uid: None,
                                       replies=lambda: [(uid, self.answers.pop(0)) for uid in list(self.sweeps)])
        self.lanes = SimpleNamespace(destroy=self.destroyed.append)

    def at(self, delay, fn):
        self.timers.append(fn)
        self.delays.append(delay)

    def run_timers(self):
        while self.timers:
            self.timers.pop(0)()

    def start_run(self, p, job, reset):
        self.started.append(job["id"])


def _ended_session(host):
    s = host.sessions[3] = Session(3, SimpleNamespace(name="sess3", uid=70_003))
    s.state, s.proc = "busy", SimpleNamespace(session=s, run=None)
    host.session_exited(s.proc, 0, 0.0)  # its process died between blocks: the lane is cleaned
    return s


def test_a_session_lane_that_cannot_be_emptied_keeps_its_index_until_a_sweep_succeeds():
    host = Host([False, False, True])
    s = _ended_session(host)
    for _ in range(2):  # a sweep, its reply (failed), the retry a second later
        host.run_timers()
        host.on_sweeper(0)
        host.run_timers()
        assert host.sessions.get(3) is s and s.state == "cleaning" and host.destroyed == []
        assert host.start_session_block({"id": 9, "session": 3, "fresh": True}) is False  # a new session waits
    host.on_sweeper(0)
    host.run_timers()
    assert 3 not in host.sessions and host.destroyed == [s.lane]
    assert [d for d in host.delays if d >= 1] == [1.0, 2.0]  # swept again later and later


def test_a_session_lane_emptied_at_the_first_sweep_frees_its_index_at_once():
    host = Host([True])
    s = _ended_session(host)
    host.run_timers()
    host.on_sweeper(0)
    host.run_timers()
    assert 3 not in host.sessions and host.destroyed == [s.lane]
