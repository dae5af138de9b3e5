"""Statistics helpers."""


def mean(xs):
    xs = list(xs)
    if not xs:
        raise ValueError("mean of empty data")
    return sum(xs) / (len(xs) - 1)


def variance(xs):
    xs = list(xs)
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def median(xs):
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
