"""The pages' inline stylesheet and script (no external resource of any kind)."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em 2em;color:#222;max-width:1400px}
h1{font-size:1.45em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .4em;border-bottom:1px solid #ddd}
code,pre,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#f6f6f6;padding:.6em;overflow:auto;white-space:pre-wrap}
.verdict{font-size:1.1em;font-weight:600;padding:.5em .8em;border-radius:4px;margin:.4em 0}
.pass{background:#d3f0d8;color:#124d1f}.fail{background:#fbd5d0;color:#7a1408}.error{background:#fde9b8;color:#6b4a00}
dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em;margin:.3em 0}dl.kv dt{color:#666}
dl.kv dd{margin:0}.charts{display:flex;flex-wrap:wrap;gap:1em}.muted{fill:#888;color:#888}
svg text.ct{font-weight:600;font-size:12px}svg text.tick{font-size:10.5px;fill:#444}
svg rect.frame{fill:none;stroke:#bbb}svg line.grid{stroke:#eee}svg rect.bad{stroke:#900;stroke-width:2}
table{border-collapse:collapse;font-size:12.5px}th,td{padding:2px 7px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th{background:#f3f3f3;cursor:pointer;position:sticky;top:0;user-select:none}
td.t,th.t{text-align:left}tr.failed td{background:#fff1ef}th.sorted-asc::after{content:" \\25B2"}
th.sorted-desc::after{content:" \\25BC"}.controls{margin:.4em 0;display:flex;gap:1em;align-items:center}
.grid td,.grid th{text-align:center;border:1px solid #ddd;padding:6px 10px;white-space:normal}.grid td.t{text-align:left}
.grid td a{color:inherit;text-decoration:none;display:block}.small{font-size:12px;color:#555}
.cell-verdict{font-weight:600;text-transform:uppercase}
"""

JS = """
(function(){
  var table=document.getElementById('results');
  if(!table){document.body.setAttribute('data-ready','1');return;}
  var body=table.tBodies[0], rows=Array.prototype.slice.call(body.rows);
  var q=document.getElementById('filter'), kind=document.getElementById('kind'),
      failing=document.getElementById('failing'), count=document.getElementById('count');
  function apply(){
    var words=q.value.toLowerCase().split(/\\s+/).filter(Boolean), shown=0;
    rows.forEach(function(r){
      var text=r.textContent.toLowerCase();
      var ok=words.every(function(w){return text.indexOf(w)>=0;})
        && (!kind.value || r.getAttribute('data-kind')===kind.value)
        && (!failing.checked || r.getAttribute('data-passed')==='0');
      r.style.display=ok?'':'none'; if(ok){shown++;}
    });
    count.textContent=shown+' of '+rows.length+' comparisons shown';
  }
  function key(td){var v=td.getAttribute('data-v');return v===null?td.textContent:parseFloat(v);}
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
    th.addEventListener('click',function(){
      var asc=!th.classList.contains('sorted-asc');
      Array.prototype.forEach.call(table.tHead.rows[0].cells,function(c){c.classList.remove('sorted-asc','sorted-desc');});
      th.classList.add(asc?'sorted-asc':'sorted-desc');
      rows.sort(function(a,b){
        var x=key(a.cells[i]),y=key(b.cells[i]);
        if(typeof x==='number'&&typeof y==='number'){
          if(isNaN(x)){return isNaN(y)?0:1;} if(isNaN(y)){return -1;} return asc?x-y:y-x;}
        return asc?String(x).localeCompare(String(y)):String(y).localeCompare(String(x));
      });
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
  var params=new URLSearchParams(location.hash.slice(1));
  if(params.get('q')){q.value=params.get('q');}
  if(params.get('kind')){kind.value=params.get('kind');}
  if(params.get('failing')==='1'){failing.checked=true;}
  [q,kind,failing].forEach(function(el){el.addEventListener('input',apply);el.addEventListener('change',apply);});
  apply();
  document.body.setAttribute('data-ready','1');
})();
"""
