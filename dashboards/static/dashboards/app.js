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
