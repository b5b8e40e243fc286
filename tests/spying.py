"""Recording whether a fast path ran: wraps ``owner.name`` (a module function or a class's method) for
the test's duration and appends, per call, whether it returned something (True) or declined (None)."""


def record_calls(monkeypatch, owner, name: str) -> list:
    used = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        used.append(result is not None)
        return result

    monkeypatch.setattr(owner, name, spy)
    return used
