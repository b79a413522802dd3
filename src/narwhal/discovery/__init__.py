"""Engine discovery: engines that come and go as Kubernetes pods, fed into the same fleet
table as `[[engines]]`, the admin API and reloads (`narwhal.router.discovery`)."""
