import json, sys, time, http.client, random, concurrent.futures as cf
# usage: prefix-run.py PORT OUT.json [GROUPS [USERS]]  (defaults 4 groups, 6 users)
port=int(sys.argv[1]); out=sys.argv[2]
ngroups=int(sys.argv[3]) if len(sys.argv)>3 else 4
nusers=int(sys.argv[4]) if len(sys.argv)>4 else 6
random.seed(25)
words="alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon".split()
groups=[" ".join(random.choice(words) for _ in range(110)) for g in range(ngroups)]
reqs=[]
for u in range(nusers):
    for g in range(ngroups):
        q=" ".join(random.choice(words) for _ in range(8))
        reqs.append((g,u,"Context %d: %s\nQuestion %d: %s?"%(g,groups[g],u,q)))
def run(p):
    c=http.client.HTTPConnection("127.0.0.1",port,timeout=120)
    body=json.dumps({"model":"lumen-tiny","prompt":p,"max_tokens":12,"temperature":0,"stream":True})
    t0=time.time(); c.request("POST","/v1/completions",body,{"content-type":"application/json"})
    r=c.getresponse(); ttft=None; text=""
    for line in r:
        line=line.decode().strip()
        if not line.startswith("data: ") or line=="data: [DONE]": continue
        d=json.loads(line[6:])
        if "choices" in d and d["choices"]:
            if ttft is None: ttft=time.time()-t0
            text+=d["choices"][0].get("text","")
    return ttft,text
res=[]
# first turn of each group sequentially (warms caches), then the rest 4 at a time
for g,u,p in reqs[:ngroups]: res.append(run(p))
with cf.ThreadPoolExecutor(4) as ex:
    res+=list(ex.map(run,[p for _,_,p in reqs[ngroups:]]))
json.dump({"ttft":[r[0] for r in res],"text":[r[1] for r in res],"prompt_chars":[len(p) for _,_,p in reqs]},open(out,"w"))
import statistics as st
print("requests",len(res),"ttft mean %.1f ms p50 %.1f ms"%(1000*st.mean(r[0] for r in res),1000*st.median(r[0] for r in res)))
