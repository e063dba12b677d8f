"""The reference server's worker registry as the learner's pusher reads it, without a server."""


class Registry:
    def __init__(self, workers: list[dict]):
        self.list, self.versions = workers, []

    def workers(self) -> list[dict]:
        return [dict(w) for w in self.list]

    def set_version(self, v: int) -> None:
        self.versions.append(v)
