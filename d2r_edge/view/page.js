(function(){
"use strict";
var DATA=JSON.parse(document.getElementById("d2r-data").textContent);
var cards=DATA.cards, PAGE=50, shown=0, matches=[];
function prep(list){list.forEach(function(c){c._text=(c.id+"\n"+c.query+"\n"+c.first_answer+"\n"+c.final_answer+"\n"+
  c.gold).toLowerCase();});return list;}
function el(tag,cls,text){var e=document.createElement(tag);if(cls)e.className=cls;
  if(text!==undefined&&text!==null)e.textContent=String(text);return e;}
function fmt(v,d){return (v===null||v===undefined)?"-":Number(v).toFixed(d===undefined?3:d);}
function tag(text,cls){return el("span","tag"+(cls?" "+cls:""),text);}
function bar(p){var b=el("div","bar");if(!p)return el("span","meta","not scored");
  ["e","n","c"].forEach(function(k,i){var s=el("i",k);s.style.width=Math.max(0,Math.min(1,p[i]||0))*100+"%";
  s.title=DATA.nli[i]+" "+fmt(p[i]);b.appendChild(s);});return b;}
function passages(att){var box=el("div");
  box.appendChild(el("div","meta","NLI bars: green entailment \u00b7 grey neutral \u00b7 red contradiction"));
  att.passages.forEach(function(p){var row=el("div","p"),t=el("div","t");
    t.appendChild(el("b",null,p.title||p.id));t.appendChild(el("span","meta"," ["+p.id+"]"));
    if(p.text)t.appendChild(el("div","meta",p.text));row.appendChild(t);
    var q=el("div");q.appendChild(el("div","meta","vs query"));q.appendChild(bar(p.q));row.appendChild(q);
    var r=el("div");r.appendChild(el("div","meta","vs response"));r.appendChild(bar(p.r));row.appendChild(r);
    box.appendChild(row);});return box;}
function waterfall(c){var box=el("div"),parts=c.waterfall||[];
  var total=c.total_s||parts.reduce(function(a,p){return a+p[1];},0)||1,at=0;
  parts.forEach(function(p,i){var line=el("div","wf"),seg=el("i","s"+Math.min(i,5)),name=p[0];
    if(name==="repair"&&c.repair)name="repair ("+c.repair.arm+(c.repair_generate_s!==null?", its generation "+
      fmt(c.repair_generate_s*1000,1)+" ms":"")+")";
    seg.style.left=(at/total*100)+"%";seg.style.width=Math.max(0.4,p[1]/total*100)+"%";line.appendChild(seg);
    box.appendChild(el("div","meta",name+" "+fmt(p[1]*1000,1)+" ms"));box.appendChild(line);at+=p[1];});
  box.appendChild(el("div","meta","total "+fmt(total*1000,1)+" ms"));
  return box;}
function mark(v){return v===null?"":(v?" \u2713":" \u2717");}
function render(c){var d=el("div","card");
  var h=el("h3",null,c.query);d.appendChild(h);
  var m=el("div","meta");m.appendChild(tag(c.failure,c.failure==="no_failure"?"ok":"warn"));
  if(c.repair)m.appendChild(tag("repaired: "+c.repair.arm));
  if(c.changed)m.appendChild(tag("answer changed"));
  if(c.first_correct===false&&c.final_correct===true)m.appendChild(tag("wrong \u2192 right","ok"));
  if(c.first_correct===true&&c.final_correct===false)m.appendChild(tag("right \u2192 wrong","bad"));
  if(c.repair&&c.repair.over_budget)m.appendChild(tag("over budget","bad"));
  if(c.trusted!==null)m.appendChild(tag(c.trusted?"trusted":"untrusted",c.trusted?"ok":"warn"));
  if(c.abstained)m.appendChild(tag("abstained","warn"));
  if(c.error)m.appendChild(tag("error","bad"));
  m.appendChild(el("span",null," id "+c.id+(c.task?" \u00b7 "+c.task:"")+(c.gate?" \u00b7 gate "+c.gate:"")+
    " \u00b7 "+fmt(c.total_s*1000,1)+" ms"));d.appendChild(m);
  var a=el("div","ans");
  [["gold",c.gold,null],["first",c.first_answer,c.first_correct],["final",c.final_answer,c.final_correct]].forEach(function(r){
    if(r[0]==="gold"&&!r[1])return;a.appendChild(el("div","meta",r[0]));a.appendChild(el("div",null,r[1]+mark(r[2])));});
  d.appendChild(a);
  if(c.abstained&&c.withheld!==null)d.appendChild(el("div","meta","withheld (untrusted): "+c.withheld));
  if(c.error)d.appendChild(el("div","meta","error: "+c.error));
  if(c.repair_error)d.appendChild(el("div","meta","repair error (first answer kept): "+c.repair_error));
  if(c.first){var s=el("div","meta","signals: e_q "+c.first.e_q+" \u00b7 e_r "+c.first.e_r+" \u00b7 KG "+c.first.kg+
      (c.p_wrong!==null?" \u00b7 P(wrong) "+fmt(c.p_wrong):"")+(c.first.label?" \u00b7 label "+c.first.label:"")+
      (c.first.gated&&c.first.gated!==c.first.label?" (gated "+c.first.gated+")":""));d.appendChild(s);
    var det=el("details");det.appendChild(el("summary",null,"first attempt: "+c.first.passages.length+" passages, response"));
    det.appendChild(el("div","meta","response: "+c.first.response));det.appendChild(passages(c.first));d.appendChild(det);}
  if(c.repair){var r=c.repair,rd=el("details");rd.open=true;
    rd.appendChild(el("summary",null,"repair: "+r.arm+" \u00b7 "+fmt(r.latency_s*1000,1)+" ms"+
      (r.budget_s!==null?" of "+fmt(r.budget_s*1000,0)+" ms":"")+" \u00b7 "+fmt(r.mem_mib,2)+" MiB"+
      (r.budget_mib!==null?" of "+fmt(r.budget_mib,1)+" MiB":"")+" ("+r.memory_kind+")"));
    rd.appendChild(el("div","meta","allowed: "+(r.allowed.join(", ")||"none")));
    if(r.cost_masked.length)rd.appendChild(el("div","meta","masked by cost: "+r.cost_masked.join(", ")));
    Object.keys(r.unavailable).forEach(function(k){rd.appendChild(el("div","meta","unavailable "+k+": "+r.unavailable[k]));});
    rd.appendChild(el("div","meta","reward "+fmt(r.reward)+(r.explored?" \u00b7 explored":"")+
      (r.policy_ms!==null?" \u00b7 policy "+fmt(r.policy_ms,3)+" ms":"")));
    if(c.final){var fd=el("details");fd.appendChild(el("summary",null,"after repair: "+c.final.passages.length+
      " passages, failure "+c.final.failure));fd.appendChild(el("div","meta","response: "+c.final.response));
      fd.appendChild(passages(c.final));rd.appendChild(fd);}
    d.appendChild(rd);}
  var w=el("details");w.appendChild(el("summary",null,"stage times"));w.appendChild(waterfall(c));d.appendChild(w);
  return d;}
var q=document.getElementById("q"),fail=document.getElementById("failure"),list=document.getElementById("cards"),
    count=document.getElementById("count"),more=document.getElementById("more");
Object.keys(DATA.failures).forEach(function(k){var o=el("option",null,k+" ("+DATA.failures[k]+")");o.value=k;fail.appendChild(o);});
prep(cards);
var checks={repaired:function(c){return !!c.repair;},changed:function(c){return c.changed;},
  fixed:function(c){return c.first_correct===false&&c.final_correct===true;},
  broken:function(c){return c.first_correct===true&&c.final_correct===false;},
  untrusted:function(c){return c.trusted===false;},
  wrong:function(c){return c.final_correct===false;},right:function(c){return c.final_correct===true;},
  over:function(c){return !!(c.repair&&c.repair.over_budget);},error:function(c){return !!c.error;}};
function apply(keep){var text=q.value.trim().toLowerCase(),f=fail.value,on=[],want=keep?Math.max(shown,PAGE):PAGE;
  Object.keys(checks).forEach(function(k){if(document.getElementById("f-"+k).checked)on.push(checks[k]);});
  matches=cards.filter(function(c){return (!f||c.failure===f)&&(!text||c._text.indexOf(text)>=0)&&
    on.every(function(fn){return fn(c);});});
  list.textContent="";shown=0;page(want);}
function page(n){var end=Math.min(matches.length,shown+(n>0?n:PAGE)),frag=document.createDocumentFragment();
  for(var i=shown;i<end;i++)frag.appendChild(render(matches[i]));list.appendChild(frag);shown=end;
  count.textContent=matches.length+" of "+cards.length+" records \u00b7 showing "+shown;
  more.hidden=shown>=matches.length;}
function fresh(){apply(false);}
q.addEventListener("input",fresh);fail.addEventListener("change",fresh);
Object.keys(checks).forEach(function(k){document.getElementById("f-"+k).addEventListener("change",fresh);});
more.addEventListener("click",function(){page(PAGE);});
window.addEventListener("scroll",function(){if(!more.hidden&&window.innerHeight+window.scrollY>=document.body.offsetHeight-400)page(PAGE);});
apply(false);
if(DATA.live){var last=JSON.stringify(cards.map(function(c){return c.id;}));
  setInterval(function(){fetch(DATA.live,{credentials:"same-origin",cache:"no-store"}).then(function(r){
    if(!r.ok)throw new Error("HTTP "+r.status);return r.json();}).then(function(d){
    var ids=JSON.stringify(d.cards.map(function(c){return c.id;}));if(ids===last)return;last=ids;
    cards=prep(d.cards);apply(true);}).catch(function(e){count.textContent="refresh failed: "+e.message;});},DATA.poll_ms);}
document.body.setAttribute("data-ready","1");
})();
