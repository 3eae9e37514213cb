;;; eglot_complete.el --- drive canvas-ls through eglot in Emacs batch mode (tests/test_emacs.py)  -*- lexical-binding: t; -*-
;; Loads editors/emacs/canvas-ls.el as a user would, opens $CANVAS_LS_FILE, starts eglot, waits for the model,
;; puts point after the first "return " and runs `completion-at-point'; prints one JSON line: the line before and
;; after, and what canvas/fill says the server offers there; then "Learn this workspace" for a folder that does not
;; exist (the server's error, as the user sees it).

(dolist (dir (file-expand-wildcards "/usr/share/emacs/site-lisp/elpa/*"))  ; Debian's elpa-eglot on Emacs 28
  (add-to-list 'load-path dir))
(require 'eglot)
(require 'json)
(add-to-list 'load-path (getenv "CANVAS_LS_EMACS"))
(require 'canvas-ls)
(setq canvas-ls-command (list (getenv "CANVAS_LS_PYTHON") "-m" "canvas_ls.server.cli" "serve"))
(setq canvas-ls-initialization-options
      `(:engine (:model ,(getenv "CANVAS_LS_MODEL") :device "cpu")
        :completion (:speculate :json-false :max_new_tokens_single_line 4)))

(find-file (getenv "CANVAS_LS_FILE"))
(apply #'eglot (eglot--guess-contact))  ; what M-x eglot does, without its prompts
(let ((server (eglot-current-server))
      (deadline (+ (float-time) 120)))
  (while (not (equal "ready" (plist-get (plist-get (jsonrpc-request server :canvas/stats nil) :engine) :state)))
    (when (> (float-time) deadline)
      (error "The model did not load: %S" (jsonrpc-request server :canvas/stats nil)))
    (sleep-for 0.2))
  (goto-char (point-min))
  (search-forward "return ")
  (let* ((line (lambda () (buffer-substring-no-properties (line-beginning-position) (line-end-position))))
         (before (funcall line))
         (offered (jsonrpc-request server :canvas/fill (eglot--TextDocumentPositionParams))))
    (completion-at-point)
    (let ((learn (condition-case err (canvas-ls-learn-workspace "/nonexistent-canvas-ls/")
                   (user-error (error-message-string err))))
          (after (funcall line)))
      ;; M-\ (canvas-ls-mode's key) inside the word "area": nothing can be shown there, and the server says why
      (goto-char (point-min))
      (search-forward "def ar")
      (execute-kbd-macro (kbd "M-\\"))
      (let ((deadline (+ (float-time) 10)))
        (while (and (not (string-match-p "no suggestion" (with-current-buffer "*Messages*" (buffer-string))))
                    (< (float-time) deadline))
          (accept-process-output nil 0.1)))
      (canvas-ls-refresh-status t)
      (princ (concat (json-encode `((before . ,before) (after . ,after)
                                    (offered . ,(plist-get (plist-get offered :edit) :text))
                                    (source . ,(plist-get offered :source))
                                    (learn . ,learn)
                                    (mode . ,(if canvas-ls-mode "on" "off"))
                                    (said . ,(seq-find (lambda (l) (string-match-p "no suggestion" l))
                                                       (split-string (with-current-buffer "*Messages*"
                                                                       (buffer-string)) "\n")))
                                    (modeline . ,(canvas-ls-mode-line))))
                     "\n")))
    (eglot-shutdown server)))
;;; eglot_complete.el ends here
