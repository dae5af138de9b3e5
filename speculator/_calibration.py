"""How far to trust each predictor's stated probabilities, learned online from how its guesses fared."""

from __future__ import annotations

__all__ = ["Calibration"]


class Calibration:
    """Per predictor (``source``): observed over expected hits, first over every guess it made (launched or not: the
    runtime scores each decided call, ``observe``) with ``prior_weight`` guesses' worth of a calibrated prior, then
    over the guesses it launched (``launched``) with ``prior_weight`` launches' worth of the first as prior: the
    launched guesses are the confident ones and those the cache could not serve, which may fare worse than the rest,
    and they are what a launch decision bets on. A predictor whose guesses never match the workload soon stops
    launching, a well calibrated one keeps its probabilities."""

    def __init__(self, prior_weight: float = 2.0) -> None:
        self.prior_weight = prior_weight
        self._every: dict[str, list[float]] = {}  # source -> [hits, expected hits], every guess
        self._launched: dict[str, list[float]] = {}  # source -> [used, expected used], launched guesses

    def factor(self, source: str) -> float:
        """Observed over expected hits of ``source``'s launched guesses, shrunk (``prior_weight`` launches' worth)
        towards those of all its guesses, which are shrunk towards 1 the same way."""
        hits, expected = self._every.get(source, (0.0, 0.0))
        every = (hits + self.prior_weight) / (expected + self.prior_weight)
        used, launched = self._launched.get(source, (0.0, 0.0))
        return (used + self.prior_weight * every) / (launched + self.prior_weight)

    def observe(self, source: str, probability: float, hit: bool) -> None:
        """``source``'s guesses for one decided call summed to ``probability``; ``hit``: one was the call."""
        acc = self._every.setdefault(source, [0.0, 0.0])
        acc[0] += hit
        acc[1] += probability

    def launched(self, source: str, probability: float, used: bool) -> None:
        """A launch of ``source``'s, stated ``probability``, ended; ``used``: the main line took it."""
        acc = self._launched.setdefault(source, [0.0, 0.0])
        acc[0] += used
        acc[1] += probability
