import json, sys, time, http.client, random, concurrent.futures as cf
port=int(sys.argv[1]); out=sys.argv[2]
random.seed(25)
words="alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon".split()
groups=[" ".join(random.choice(words) for _ in range(110)) for g in range(4)]
reqs=[]
for u in range(6):
    for g in range(4):
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
for g,u,p in reqs[:4]: res.append(run(p))
with cf.ThreadPoolExecutor(4) as ex:
    res+=list(ex.map(run,[p for _,_,p in reqs[4:]]))
json.dump({"ttft":[r[0] for r in res],"text":[r[1] for r in res],"prompt_chars":[len(p) for _,_,p in reqs]},open(out,"w"))
import statistics as st
print("requests",len(res),"ttft mean %.1f ms p50 %.1f ms"%(1000*st.mean(r[0] for r in res),1000*st.median(r[0] for r in res)))
