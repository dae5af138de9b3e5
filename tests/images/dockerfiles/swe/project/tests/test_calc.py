import unittest

import calc


class CalcTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(calc.mean([1, 2, 3, 4]), 2.5)

    def test_median(self):
        self.assertEqual(calc.median([3, 1, 2]), 2)
        self.assertEqual(calc.median([4, 1, 3, 2]), 2.5)


if __name__ == "__main__":
    unittest.main()
