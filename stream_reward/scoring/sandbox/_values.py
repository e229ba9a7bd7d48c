"""Data that crosses back to the trusted checker besides an answer: a value the
candidate returned, rebuilt as its own type (``rebuilt_value``), and an argument
the candidate changed in place, written back into the test's object
(``sync_in_place``).

Pasted, as source, in front of ``_remote`` (the checker's process imports
nothing of stream_reward): stdlib only, every name public here is used there.
"""

_IN_PLACE = (list, dict, set, bytearray)


def rebuilt_value(form, data):
    """The value ``plain_value`` described, as the same type here."""
    if form == "plain":
        return data
    if form == "keys" and type(data) is list:
        return dict.fromkeys(data).keys()
    if form == "values" and type(data) is list:
        return dict(enumerate(data)).values()
    if form == "items" and type(data) is list and all(type(i) is tuple and len(i) == 2 for i in data):
        return dict(data).items()
    if form == "range" and type(data) is list and len(data) == 3 and all(type(i) is int for i in data):
        return range(*data)
    if form == "deque" and type(data) is list and len(data) == 2 and type(data[0]) is list:
        import collections

        if data[1] is None or type(data[1]) is int:
            return collections.deque(data[0], data[1])
    if form == "fraction" and type(data) is list and len(data) == 2 and all(type(i) is int for i in data):
        import fractions

        return fractions.Fraction(*data)
    if form == "decimal" and type(data) is str and len(data) < 10_000:
        import decimal

        return decimal.Decimal(data)
    raise TypeError(form)


def sync_in_place(old, new):
    """``old`` (the test's) made equal to ``new`` (the candidate's copy after the call),
    keeping the identity of the containers inside that both still have."""
    t = type(old)
    if t is bytearray and type(new) is bytes:
        old[:] = new
    elif t is not type(new) or t not in _IN_PLACE:
        return
    elif t is list:
        for i in range(min(len(old), len(new))):
            if type(old[i]) in _IN_PLACE and type(old[i]) is type(new[i]):
                sync_in_place(old[i], new[i])
            else:
                old[i] = new[i]
        del old[len(new) :]
        old.extend(new[len(old) :])
    elif t is dict:
        for k in [k for k in old if k not in new]:
            del old[k]
        for k, v in new.items():
            if k in old and type(old[k]) in _IN_PLACE and type(old[k]) is type(v):
                sync_in_place(old[k], v)
            else:
                old[k] = v
    elif t is set:
        old.clear()
        old.update(new)
