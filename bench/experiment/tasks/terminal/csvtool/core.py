import fastcsv
import colstats


def summarize(text):
    """{column: {"n", "mean", "min", "max"}} of a CSV text with a header row."""
    rows = fastcsv.parse(text)
    header, data = rows[0], rows[2:]
    columns = list(zip(*data))
    return {name: colstats.describe([float(v) for v in col]) for name, col in zip(header, columns)}
