#!/bin/bash
# $1: comma list of sets, run one set at a time: the eager loop off CUDA (no --fast-path), outputs in /tmp/c1
OUT=/tmp/c1 PATH_FLAG= bash /work/main/docs/logs/c1_guess_cpu_1205/run_bench.sh "$1"
