import random
import unittest

from csvtool import summarize


def sample(n, seed):
    rng = random.Random(seed)
    lines = ["a,b,c"] + [f"{rng.randrange(100)},{rng.random():.6f},{i}" for i in range(n)]
    return "\n".join(lines) + "\n"


class SummarizeTest(unittest.TestCase):
    def test_small(self):
        out = summarize("x,y\n1,10\n2,20\n3,30\n")
        self.assertEqual(out["x"], {"n": 3, "mean": 2.0, "min": 1.0, "max": 3.0})
        self.assertEqual(out["y"]["mean"], 20.0)

    def test_large(self):
        for seed in range(6):
            out = summarize(sample(40000, seed))
            self.assertEqual(out["c"]["n"], 40000)
            self.assertEqual(out["c"]["mean"], (40000 - 1) / 2)


if __name__ == "__main__":
    unittest.main()
