"""GET-only HTTP routes of the lab node, served by the scheduler's own HTTP server.

``/goblin/report.json`` is public (it is the lab's verification report), but only its totals:
volunteer names and per-volunteer counts go to lab admins (and loopback, where the dashboard
guard trusts it; see ``scheduler_plugins.dashboard_guard``).

``/goblin/`` is the lab's page, a live view of ``/goblin/api/status`` (polled every second, no reload):
totals, verification by method and its overhead, credit, where tasks ran (sent to volunteers, or kept at the
lab and why, with the setting that would send them out), computations in flight with their progress,
plots of verified results and throughput over time drawn as plain SVG, and researchers' training runs
(an opaque id, round, loss, seconds per round, verification counts: numbers only) with their loss curve.  The same rule: everyone
sees the totals; the per-volunteer table (name, trust, accepted, rejected, banned, late, credit, status,
threads, memory, exposure) goes to lab admins and trusted loopback.  No keys, no code, no data.
A signed-in lab admin may revoke a volunteer from the page (``POST /goblin/api/revoke``, with the
XSRF token; the guard lets only trusted requests reach it, and it takes admins only).
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from tornado import web

from goblin_dask.array.placement import KEPT_AT_LAB

logger = logging.getLogger("goblin_dask.http")

#: the keys of the report everyone may read
PUBLIC_KEYS = ("tasks", "accepted", "rejected", "by_method", "overhead", "reissued", "seconds", "placement")


def public_report(report: dict) -> dict:
    public = {k: report[k] for k in PUBLIC_KEYS if k in report}
    public["volunteer_count"] = len(report.get("volunteers", ()))
    return public


class ReportHandler(web.RequestHandler):
    def initialize(self, ledger):
        self.ledger = ledger

    def get(self):
        report = self.ledger.report()
        if not getattr(self.request, "goblin_trusted", None):  # set by the dashboard guard
            report = public_report(report)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(report))


def computations(scheduler, last: int = 10) -> list[dict]:
    """The latest computations' progress (task counts by state only: no keys, no code)."""
    out = []
    for comp in list(getattr(scheduler, "computations", ()))[-last:]:
        states = comp.states
        total = sum(states.values())
        done = sum(states.get(s, 0) for s in ("memory", "released", "forgotten"))
        pending = sum(states.get(s, 0) for s in ("waiting", "processing", "no-worker", "queued"))
        out.append({"id": str(comp.id)[:8], "start": comp.start, "tasks": total, "done": done,
                    "processing": states.get("processing", 0), "erred": states.get("erred", 0),
                    "in_flight": pending > 0, "progress": done / total if total else 1.0})
    return out


def lab_status(scheduler, ledger, trusted: str | None) -> dict:
    """What ``/goblin/api/status`` serves (the per-volunteer rows only when ``trusted``: "admin" or "loopback")."""
    report = ledger.report()
    status = public_report(report)
    admission = ledger.admission
    connected = {admission.names.get(a, a): scheduler.workers[a] for a in admission.volunteers()
                 if a in scheduler.workers}
    status.update({
        "time": time.time(),
        "credit": report.get("credit", 0.0),
        "connected": len(connected),
        "paused": sum(ws.status.name == "paused" for ws in connected.values()),
        "computations": computations(scheduler),
        # researchers' training runs: an opaque id, rounds, loss, seconds, verification counts (numbers only)
        "training": training.status() if (training := scheduler.plugins.get("goblin-training")) else {"runs": []},
        "can_revoke": trusted == "admin",
        # why tasks stayed at the lab: {reason: the setting that would send them out, or None}
        "kept_settings": KEPT_AT_LAB,
    })
    if trusted:
        status["placement_by_researcher"] = report.get("placement_by_researcher", {})
        exposure = report.get("exposure") or {}
        rows = []
        for name in sorted(set(report.get("volunteers", {})) | set(connected)):
            record = report.get("volunteers", {}).get(name, {})
            ws = connected.get(name)
            rows.append({"name": name, **{k: record.get(k, 0) for k in ("trust", "accepted", "rejected", "late",
                                                                         "failed", "credit")},
                         "banned": bool(record.get("banned", False)),
                         "status": ws.status.name if ws is not None else "gone",
                         "threads": ws.nthreads if ws is not None else None,
                         "memory": ws.memory_limit if ws is not None else None,
                         "processing": len(ws.processing) if ws is not None else 0,
                         "exposure": max((exposure.get(name) or {}).values(), default=0.0)})
        status["volunteers"] = rows
    return status


class StatusHandler(web.RequestHandler):
    def initialize(self, ledger, scheduler):
        self.ledger, self.scheduler = ledger, scheduler

    def get(self):
        trusted = getattr(self.request, "goblin_trusted", None)  # set by the dashboard guard
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(lab_status(self.scheduler, self.ledger, trusted)))


class _StrictCookies(web.RequestHandler):
    def set_cookie(self, name: str, value, **kwargs) -> None:
        """The XSRF cookie as the sign-in pages set it: HttpOnly, SameSite=Strict, Secure over HTTPS."""
        kwargs.update(httponly=True, samesite="Strict", secure=self.request.protocol == "https")
        super().set_cookie(name, value, **kwargs)


class RevokeHandler(_StrictCookies):
    """``POST /goblin/api/revoke`` (``name``, ``_xsrf``): a signed-in lab admin revokes a volunteer."""

    def initialize(self, ledger):
        self.ledger = ledger

    def post(self):  # tornado checked the XSRF token before this runs
        if getattr(self.request, "goblin_trusted", None) != "admin":
            raise web.HTTPError(403, "revoking a volunteer needs a lab admin's session")
        name = self.get_body_argument("name", "")
        admission = self.ledger.admission
        if name not in self.ledger.volunteers and name not in admission.names.values():
            raise web.HTTPError(404)
        closed = admission.revoke(name)
        logger.warning("lab admin revoked volunteer %s from the lab page", name)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"revoked": name, "closed": len(closed)}))


class LabPageHandler(_StrictCookies):
    def get(self):
        nonce = secrets.token_urlsafe(16)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("Content-Security-Policy", f"default-src 'none'; script-src 'nonce-{nonce}'; "
                        "style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Referrer-Policy", "no-referrer")
        xsrf = self.xsrf_token.decode()  # the visitor's own token (used by an admin's revoke buttons)
        self.write(LAB_PAGE.replace("{nonce}", nonce).replace("{xsrf}", xsrf))


LAB_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>goblin lab node</title><meta name="goblin-xsrf" content="{xsrf}">
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
.num{font-size:1.6em;font-weight:600} .cards{display:flex;gap:1.5em;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;min-width:8em}
table{border-collapse:collapse;margin:.5em 0} td,th{border-bottom:1px solid #eee;padding:3px 10px;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left} svg{border:1px solid #ddd;background:#fafafa}
.bar{background:#eee;width:12em;height:.8em;display:inline-block} .bar>span{background:#4a8;height:100%;display:block}
</style></head><body>
<h1>goblin lab node</h1>
<p>Every volunteer result is checked before it is used. Updated every second
(<a href="/goblin/api/status">/goblin/api/status</a>; <a href="/status">dask's dashboard</a> for lab admins).</p>
<div class="cards">
<div class="card">tasks<div class="num" id="tasks">-</div></div>
<div class="card">accepted<div class="num" id="accepted">-</div></div>
<div class="card">rejected<div class="num" id="rejected">-</div></div>
<div class="card">overhead<div class="num" id="overhead">-</div></div>
<div class="card">credit<div class="num" id="credit">-</div></div>
<div class="card">volunteers<div class="num" id="connected">-</div></div>
</div>
<h2>Verification by method</h2><table id="methods"><tr><th>method</th><th>results</th></tr></table>
<h2>Over time</h2>
<p>verified results (accepted, total) and throughput (results per second)</p>
<svg id="verified" width="480" height="140"></svg> <svg id="throughput" width="480" height="140"></svg>
<h2 id="vh" hidden>Volunteers</h2><table id="volunteers" hidden><tr><th>name</th><th>status</th><th>trust</th>
<th>accepted</th><th>rejected</th><th>late</th><th>banned</th><th>credit</th><th>threads</th><th>memory</th>
<th>exposure</th><th></th></tr></table>
<h2>Where tasks ran</h2><p><span id="sent">-</span> catalog tasks sent to volunteers,
<span id="kept">-</span> kept at the lab.</p>
<table id="why"><tr><th>kept at the lab because</th><th>tasks</th><th>the setting that would send them out</th></tr></table>
<table id="researchers" hidden><tr><th>researcher</th><th>to volunteers</th><th>kept at the lab</th><th>why</th></tr></table>
<h2>Computations</h2><table id="computations"><tr><th>id</th><th>tasks</th><th>done</th><th>progress</th></tr></table>
<h2>Training runs</h2><p id="no-training">none yet (a <code>Trainer</code> reports each finished round)</p>
<table id="training" hidden><tr><th>run</th><th>round</th><th>loss</th><th>s / round</th><th>accepted</th><th>rejected</th></tr></table>
<svg id="loss" width="480" height="160" hidden></svg>
<script nonce="{nonce}">
"use strict";
const hist = [];
function flops(x){const u=[["P",1e15],["T",1e12],["G",1e9],["M",1e6],["k",1e3]];
  for(const [n,s] of u){if(x>=s)return (x/s).toPrecision(3)+" "+n+"FLOP";} return Math.round(x)+" FLOP";}
function bytes(x){if(x==null)return "-";const u=[["GB",1e9],["MB",1e6]];
  for(const [n,s] of u){if(x>=s)return (x/s).toPrecision(3)+" "+n;} return x+" B";}
function set(id,v){document.getElementById(id).textContent=v;}
function rows(table,data){const t=document.getElementById(table);
  while(t.rows.length>1)t.deleteRow(1);
  for(const r of data){const tr=t.insertRow();for(const c of r){const td=tr.insertCell();
    if(c instanceof Node)td.appendChild(c);else td.textContent=c;}}}
async function revoke(name){if(!confirm("Revoke volunteer "+name+"? It is disconnected and refused from now on."))return;
  const body=new URLSearchParams({name:name,_xsrf:document.querySelector('meta[name="goblin-xsrf"]').content});
  await fetch("/goblin/api/revoke",{method:"POST",body:body});}
function button(name){const b=document.createElement("button");b.textContent="revoke";
  b.addEventListener("click",()=>revoke(name));return b;}
function bar(p){const b=document.createElement("span");b.className="bar";const i=document.createElement("span");
  i.style.width=(100*p).toFixed(1)+"%";b.appendChild(i);return b;}
function plot(id,series,colors){const svg=document.getElementById(id);while(svg.firstChild)svg.removeChild(svg.firstChild);
  const W=svg.width.baseVal.value,H=svg.height.baseVal.value,n=hist.length;if(n<2)return;
  const t0=hist[0].time,t1=hist[n-1].time,ymax=Math.max(1,...series.flatMap(s=>hist.map(s)));
  series.forEach((s,k)=>{const p=document.createElementNS("http://www.w3.org/2000/svg","polyline");
    p.setAttribute("points",hist.map(h=>((h.time-t0)/Math.max(t1-t0,1e-9)*(W-10)+5).toFixed(1)+","+
      (H-5-s(h)/ymax*(H-20)).toFixed(1)).join(" "));
    p.setAttribute("fill","none");p.setAttribute("stroke",colors[k]);p.setAttribute("stroke-width","2");svg.appendChild(p);});
  const l=document.createElementNS("http://www.w3.org/2000/svg","text");l.setAttribute("x",8);l.setAttribute("y",14);
  l.setAttribute("font-size","11");l.textContent="max "+ymax.toPrecision(3);svg.appendChild(l);}
const RUN_COLORS=["#c63","#36c","#4a8","#a4c","#888","#c3a"];
function lossPlot(runs){const svg=document.getElementById("loss");while(svg.firstChild)svg.removeChild(svg.firstChild);
  const W=svg.width.baseVal.value,H=svg.height.baseVal.value,pts=runs.flatMap(r=>r.history.filter(h=>h[1]!=null));
  if(!pts.length)return;
  const rmax=Math.max(2,...pts.map(h=>h[0])),lmin=Math.min(...pts.map(h=>h[1])),lmax=Math.max(...pts.map(h=>h[1]));
  const span=Math.max(lmax-lmin,1e-12),x=r=>((r-1)/(rmax-1)*(W-60)+50).toFixed(1),y=l=>(H-18-(l-lmin)/span*(H-36)).toFixed(1);
  const text=(x0,y0,t,anchor)=>{const e=document.createElementNS("http://www.w3.org/2000/svg","text");e.setAttribute("x",x0);
    e.setAttribute("y",y0);e.setAttribute("font-size","11");if(anchor)e.setAttribute("text-anchor",anchor);e.textContent=t;svg.appendChild(e);};
  text(46,14,lmax.toPrecision(3),"end");text(46,H-16,lmin.toPrecision(3),"end");text(W-8,H-4,"round "+rmax,"end");text(50,H-4,"loss by round","start");
  runs.slice(-RUN_COLORS.length).forEach((r,k)=>{const h=r.history.filter(e=>e[1]!=null);if(!h.length)return;
    const p=document.createElementNS("http://www.w3.org/2000/svg",h.length>1?"polyline":"circle");
    if(h.length>1){p.setAttribute("points",h.map(e=>x(e[0])+","+y(e[1])).join(" "));p.setAttribute("fill","none");
      p.setAttribute("stroke-width","2");p.setAttribute("stroke",RUN_COLORS[k]);}
    else{p.setAttribute("cx",x(h[0][0]));p.setAttribute("cy",y(h[0][1]));p.setAttribute("r","3");p.setAttribute("fill",RUN_COLORS[k]);}
    p.dataset.run=r.id;svg.appendChild(p);});}
async function tick(){
  try{const s=await (await fetch("/goblin/api/status",{cache:"no-store"})).json();
    set("tasks",s.tasks);set("accepted",s.accepted);set("rejected",s.rejected);
    set("overhead",(100*s.overhead).toFixed(1)+" %");set("credit",flops(s.credit));
    set("connected",s.connected+(s.paused?" ("+s.paused+" paused)":""));
    rows("methods",Object.entries(s.by_method));
    const pl=s.placement||{volunteer:0,lab:0,kept:{}};set("sent",pl.volunteer);set("kept",pl.lab);
    rows("why",Object.entries(pl.kept).map(([w,n])=>[w,n,s.kept_settings[w]||"none: "+(w==="lab-only"?
      "checking it is computing it again":"the lab computes it")]));
    const pr=s.placement_by_researcher;document.getElementById("researchers").hidden=!pr;
    if(pr)rows("researchers",Object.entries(pr).map(([n,c])=>[n,c.volunteer,c.lab,
      Object.entries(c.kept).map(([w,k])=>w+": "+k).join(", ")]));
    rows("computations",s.computations.slice(-5).reverse().map(c=>[c.id,c.tasks,c.done,bar(c.progress)]));
    const prev=hist.length?hist[hist.length-1]:null;
    const rate=prev&&s.time>prev.time?Math.max(0,(s.accepted+s.rejected-prev.accepted-prev.rejected)/(s.time-prev.time)):0;
    hist.push({time:s.time,accepted:s.accepted,rejected:s.rejected,tasks:s.tasks,rate:rate});
    if(hist.length>600)hist.shift();
    plot("verified",[h=>h.tasks,h=>h.accepted],["#888","#4a8"]);plot("throughput",[h=>h.rate],["#36c"]);
    if(s.volunteers){document.getElementById("vh").hidden=false;document.getElementById("volunteers").hidden=false;
      rows("volunteers",s.volunteers.map(v=>[v.name,v.status,v.trust,v.accepted,v.rejected,v.late,v.banned?"yes":"",
        flops(v.credit),v.threads??"-",bytes(v.memory),(100*v.exposure).toFixed(0)+" %",
        s.can_revoke&&!v.banned&&v.status!=="gone"?button(v.name):""]));}
    const runs=(s.training||{runs:[]}).runs;document.getElementById("no-training").hidden=runs.length>0;
    document.getElementById("training").hidden=document.getElementById("loss").hidden=!runs.length;
    rows("training",runs.slice().reverse().map(r=>[r.id,r.round,r.loss==null?"-":r.loss.toPrecision(4),
      r.seconds==null?"-":r.seconds.toFixed(2),r.accepted,r.rejected]));
    lossPlot(runs);
    document.body.dataset.updated=String(s.time);
  }catch(e){}
  setTimeout(tick,1000);}
tick();
</script></body></html>
"""


def install_routes(scheduler, ledger) -> None:
    app = web.Application([
        (r"/goblin/report.json", ReportHandler, {"ledger": ledger}),
        (r"/goblin/?", LabPageHandler),  # before the sign-in pages' /goblin/ (a redirect to /goblin/access)
        (r"/goblin/api/status", StatusHandler, {"ledger": ledger, "scheduler": scheduler}),
        (r"/goblin/api/revoke", RevokeHandler, {"ledger": ledger}),  # not public: the guard lets admins through
    ], xsrf_cookies=True)
    scheduler.http_application.add_application(app)
