#!/usr/bin/env python3
"""Sums an Nsight Compute source page by CUDA source line: where a kernel's instructions and
stall samples go. Input: the CSV of
  ncu --page source --print-source sass,cuda --csv -k regex:NAME -c 1 --section SourceCounters \
      [--section WarpStateStats] PROGRAM ARGS > lines.csv
(build with -lineinfo so SASS maps to source lines). Usage: ncu_lines.py lines.csv [--top N]
Prints, per kernel, the N source lines with the most executed warp instructions, with their
share and their stall samples.
"""
import csv, sys


def main():
    args = sys.argv[1:]
    if not args or args[0] in ('-h', '--help'):
        print(__doc__.strip())
        return 0 if args else 2
    top = int(args[args.index('--top') + 1]) if '--top' in args else 30
    kernel, header, per = None, None, {}
    with open(args[0], newline='') as f:
        for row in csv.reader(f):
            if not row or row[0].startswith('=='):
                continue
            if row[0] == 'Function Name':
                kernel = row[1]
                continue
            if row[0] == 'File Path':
                path = row[1].rsplit('/', 1)[-1]
                continue
            if row[0] == 'Line No':
                header = row
                continue
            if not header or len(row) != len(header) or not row[0].strip():
                continue  # SASS rows carry no line number: count each instruction once, by its line
            rec = dict(zip(header, row))
            num = lambda k: float((rec.get(k) or '0').replace(',', '') or 0)
            key = (path, int(row[0]), row[1].strip()[:80])
            d = per.setdefault(kernel, {})
            inst, samp = d.get(key, (0.0, 0.0))
            d[key] = (inst + num('Instructions Executed'), samp + num('Warp Stall Sampling (All Samples)'))
    for kernel, d in per.items():
        total = sum(v[0] for v in d.values()) or 1.0
        samples = sum(v[1] for v in d.values()) or 1.0
        print(f'{kernel[:110]}\n  {total:,.0f} warp instructions, {samples:,.0f} stall samples')
        for (path, line, src), (inst, samp) in sorted(d.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f'  {100 * inst / total:5.1f}% inst {100 * samp / samples:5.1f}% stalls  {path}:{line}  {src}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
