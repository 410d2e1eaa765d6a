/* The pod sandbox's process: it holds the pod's namespaces, reaps orphans that the
 * kernel reparents to it (it is PID 1 of a shared PID namespace) and exits on
 * SIGINT/SIGTERM. Built static, it is the only file of the e2e sandbox image (the
 * kubelet's `registry.k8s.io/pause` does the same; no registry can be reached here). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("cpuserve-pause 3.10");
    return 0;
  }
  if (getpid() != 1) fputs("pause: warning: not PID 1\n", stderr);
  struct sigaction term = {.sa_handler = on_term}, child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &term, NULL) || sigaction(SIGTERM, &term, NULL) || sigaction(SIGCHLD, &child, NULL)) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) pause();
}
