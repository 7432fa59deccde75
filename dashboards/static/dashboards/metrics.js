// Metric charts: uPlot time series fed from JSON the server renders into the
// page's live partial. The websocket (htmx's ws extension) swaps that partial
// after every scrape; each chart then takes the new data in place. Without
// JavaScript the partial's tables carry the same figures.
(function () {
  var COLORS = ["#2f5bd3", "#d9480f", "#1c7c4a", "#9c36b5", "#a15c00", "#0b7285", "#c2255c", "#5c940d"];
  var charts = {};
  window.chunkpilotCharts = charts;

  function format(display, unit, v) {
    if (v == null || !isFinite(v)) return "—";
    if (display === "duration") return Math.abs(v) < 1 ? (v * 1000).toPrecision(3) + " ms" : v.toFixed(2) + " s";
    if (display === "percent") return (v * 100).toFixed(1) + "%";
    if (display === "times") return v.toFixed(2) + "×";
    var suffix = unit === "tokens/s" ? " tok/s" : unit.slice(-2) === "/s" ? "/s" : "";
    return (Math.abs(v) >= 100 ? Math.round(v).toLocaleString() : v.toPrecision(3)) + suffix;
  }

  // The server sends each chart's axes with its data (dashboards/axes.py):
  // a value axis from zero in round steps with labels that never repeat, and
  // a time range that gives a lone point a minute either side instead of
  // uPlot's years. uPlot's own choice stands only when there is no data.
  function yRange(holder) {
    return function (u, min, max) {
      var a = holder.p.y_axis;
      if (a) return [a.min, a.max];
      return min == null || max == null || min === max ? [0, 1] : uPlot.rangeNum(min, max, 0.1, true);
    };
  }

  function xRange(holder) {
    return function (u, min, max) {
      // uPlot has already widened a lone point's instant to a day (in the
      // wrong unit: 1000 days) by the time it asks, so ask the data instead.
      var r = holder.p.x_range, t = holder.p.times;
      return r && t.length && t[0] === t[t.length - 1] ? [r[0], r[1]] : [min, max];
    };
  }

  function ticks(holder) {
    return function (u, i, min, max, incr, space) {
      var a = holder.p.y_axis;
      if (a) return a.ticks.slice();
      var out = [];
      for (var v = Math.ceil(min / incr) * incr; v <= max + incr / 1e6; v += incr) out.push(v);
      return out;
    };
  }

  function tickLabels(holder, fmt) {
    return function (u, vals) {
      var a = holder.p.y_axis;
      if (!a) return vals.map(fmt);
      return vals.map(function (v) {
        var i = a.ticks.indexOf(v);
        return i < 0 ? fmt(v) : a.labels[i];
      });
    };
  }

  // Rollout steps, aborts and profile changes (pages.chart_annotations), marked on
  // every chart's time axis as a line with its text on hover. Marks are
  // elements over the plot, so they can carry a title and be found by tests.
  function annotations() {
    var src = document.getElementById("chart-annotations");
    return src ? JSON.parse(src.textContent) : [];
  }

  function mark(u) {
    u.over.querySelectorAll(".annotation").forEach(function (n) { n.remove(); });
    var min = u.scales.x.min, max = u.scales.x.max;
    annotations().forEach(function (a) {
      if (min == null || a.t < min || a.t > max) return;
      var m = document.createElement("div");
      m.className = "annotation " + a.kind;
      m.setAttribute("data-kind", a.kind);
      m.title = new Date(a.t * 1000).toLocaleTimeString() + " " + a.text;
      m.style.left = u.valToPos(a.t, "x") + "px";
      u.over.appendChild(m);
    });
  }

  function payload(el) {
    var src = document.getElementById(el.getAttribute("data-source"));
    return src ? JSON.parse(src.textContent) : null;
  }

  function options(el, holder) {
    var p = holder.p;
    var fmt = function (v) { return format(p.display, p.unit, v); };
    return {
      width: Math.max(300, el.clientWidth),
      height: 220,
      scales: { x: { time: true, range: xRange(holder) }, y: { range: yRange(holder) } },
      legend: { live: true },
      // One crosshair across the page's charts: hovering one shows the same instant on all.
      cursor: { sync: { key: "chunkpilot-figures" } },
      plugins: [{ hooks: { draw: [mark] } }],
      series: [{}].concat(p.lines.map(function (line, i) {
        return { label: line.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false,
                 value: function (u, v) { return fmt(v); } };
      })),
      axes: [{}, { size: 70, splits: ticks(holder), values: tickLabels(holder, fmt) }],
    };
  }

  function data(p) {
    return [p.times].concat(p.lines.map(function (line) { return line.values; }));
  }

  function draw(el) {
    var p = payload(el);
    if (!p || typeof uPlot === "undefined") return;
    var id = el.getAttribute("data-chart");
    var key = p.lines.map(function (l) { return l.label; }).join("|");
    var chart = charts[id];
    if (chart && chart.el === el && chart.key === key) {
      chart.holder.p = chart.payload = p;
      chart.plot.setData(data(p));
    } else {
      if (chart) chart.plot.destroy();
      el.querySelectorAll(".uplot, .empty-chart").forEach(function (n) { n.remove(); });
      var holder = { p: p };
      charts[id] = chart = { el: el, key: key, holder: holder, payload: p };
      chart.plot = new uPlot(options(el, holder), data(p), el);
    }
    el.setAttribute("data-updates", String(Number(el.getAttribute("data-updates") || 0) + 1));
    el.classList.toggle("no-data", !p.lines.length);
  }

  function refresh() {
    document.querySelectorAll("[data-chart]").forEach(draw);
  }

  document.addEventListener("DOMContentLoaded", refresh);
  // Only a message from a socket whose element holds charts: every page
  // also has the alert banner's socket.
  document.addEventListener("htmx:wsAfterMessage", function (e) {
    if (e.target.querySelector && e.target.querySelector("[data-chart]")) refresh();
  });
  window.addEventListener("resize", function () {
    Object.keys(charts).forEach(function (id) {
      var c = charts[id];
      c.plot.setSize({ width: Math.max(300, c.el.clientWidth), height: 220 });
    });
  });
})();
