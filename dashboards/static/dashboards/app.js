// Keeps "Ns ago" figures current between server renders. Without
// JavaScript the server-rendered age is shown instead.
(function () {
  function age(seconds) {
    if (seconds < 60) return Math.max(0, Math.floor(seconds)) + "s ago";
    if (seconds < 3600) return Math.floor(seconds / 60) + "m ago";
    if (seconds < 86400) return Math.floor(seconds / 3600) + "h ago";
    return Math.floor(seconds / 86400) + "d ago";
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("time[data-age]").forEach(function (el) {
      var t = Date.parse(el.getAttribute("datetime"));
      if (!isNaN(t)) el.textContent = age((now - t) / 1000);
    });
  }
  setInterval(tick, 1000);
  document.addEventListener("DOMContentLoaded", tick);
  document.addEventListener("htmx:afterSettle", tick);
})();

// "Live updates paused" while any of the page's websockets is down for a
// reason the htmx ws extension reconnects on (abnormal closure, server
// error, restart, try again later: the control plane's store is away);
// hidden again once every one of them is open.
(function () {
  var RECONNECTS_ON = [1006, 1011, 1012, 1013];
  var down = new Set();
  // A dropped socket retries with full jitter, as htmx does, but capped at
  // 10 s instead of its 64 s: once a store is back, every open page is live
  // again within seconds, and a fleet of browsers still spreads its retries.
  if (window.htmx) htmx.config.wsReconnectDelay = function (retryCount) {
    return Math.min(10000, 1000 * Math.pow(2, retryCount)) * Math.random();
  };
  function show() {
    // A socket's element that left the page (swapped out) is not down.
    down.forEach(function (el) {
      if (!el.isConnected) down.delete(el);
    });
    var banner = document.getElementById("live-paused");
    if (banner) banner.hidden = down.size === 0;
  }
  document.addEventListener("htmx:afterSettle", show);
  document.addEventListener("htmx:wsClose", function (e) {
    var code = e.detail && e.detail.event ? e.detail.event.code : 1006;
    if (RECONNECTS_ON.indexOf(code) >= 0) down.add(e.target);
    show();
  });
  document.addEventListener("htmx:wsOpen", function (e) {
    down.delete(e.target);
    show();
  });
})();
