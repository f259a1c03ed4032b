# Sourced by the scripts here: apt_install PACKAGE... installs Debian packages with apt-get (with
# sudo unless root); given no package it does nothing.
apt_install() {
  [ "$#" -gt 0 ] || return 0
  echo "installing $* with apt-get"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
