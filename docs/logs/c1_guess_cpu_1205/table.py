"""The c=1 table of BENCHMARKS section 9 (\"The guess before a round\"): this folder's engine-path runs beside the eager
loop's of c1_tau_cpu_1205.  python docs/logs/c1_guess_cpu_1205/table.py"""
import json,glob,os,sys
new=sys.argv[1] if len(sys.argv)>1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), 'bench')
old=os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'c1_tau_cpu_1205', 'bench')
def get(path):
    d=json.load(open(path)); out={}
    for r in d['results']: out.setdefault(r['dataset'],{})[r['method']]=r
    return out
print("| set (test prompts) | `fixed` tau | `cost` tau (share of `fixed`) | `cost` mean verify length | eager loop's `cost` (share), 12-05 15:04Z | identical |")
print("|---|---|---|---|---|---|")
for p in sorted(glob.glob(new+'/*/bench.json')):
    n=os.path.basename(os.path.dirname(p))
    A=get(p)
    try: Bd=get(f'{old}/{n}/bench.json')
    except Exception: Bd={}
    for ds,a in A.items():
        f=a['fixed']['tau']; c=a['cost']['tau']
        b=Bd.get(ds)
        e=f"{b['cost']['tau']:.2f} ({b['cost']['tau']/b['fixed']['tau']:.1%})" if b else '-'
        ident = all(a[m]['identical'] for m in ('fixed','cost'))
        print(f"| {ds} ({a['cost']['num_prompts']}) | {f:.2f} | {c:.2f} ({c/f:.1%}) | {a['cost']['mean_verify_length']:.1f} | {e} | {'yes' if ident else 'NO'} |")
