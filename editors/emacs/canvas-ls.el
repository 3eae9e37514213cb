;;; canvas-ls.el --- canvas-ls with eglot or lsp-mode  -*- lexical-binding: t; -*-
;; Both clients get canvas-ls's suggestion through textDocument/completion: one completion-at-point item (also
;; what company and corfu show). Neither client shows LSP inline (ghost-text) completions.
;; Driven for real by tests/test_emacs.py: Emacs 28 with eglot 1.9 (Debian's emacs-nox and elpa-eglot).
;;
;; Usage: (require 'canvas-ls), then M-x eglot in a Python buffer (or `eglot-ensure' in the mode's hook).
;; In the buffers canvas-ls serves, `canvas-ls-mode' binds M-\ to ask for a suggestion (the server says why when
;; none comes) and shows the last outcome in the mode line; M-x canvas-ls-status lists the reasons.

(require 'seq)
(require 'subr-x)

(defgroup canvas-ls nil
  "Code completion from a text-diffusion model."
  :group 'tools)

(defcustom canvas-ls-command '("canvas-ls" "serve")
  "Command that starts the canvas-ls language server."
  :type '(repeat string))

(defcustom canvas-ls-initialization-options '(:engine (:device "auto"))
  "Options sent to the server at start (its README lists them), as a plist.
For example \\='(:engine (:model \"/path/to/model\" :device \"cpu\")
:completion (:min_confidence 0))."
  :type 'sexp)

(defconst canvas-ls-modes
  '(python-mode python-ts-mode go-mode go-ts-mode js-mode js-ts-mode typescript-ts-mode rust-mode rust-ts-mode
    c-mode c-ts-mode c++-mode c++-ts-mode java-mode lua-mode)
  "Major modes canvas-ls serves.")

(defun canvas-ls-eglot-contact (&optional _interactive)
  "The eglot contact: `canvas-ls-command' with `canvas-ls-initialization-options', read when a server starts."
  (append canvas-ls-command (list :initializationOptions canvas-ls-initialization-options)))

;;; eglot (built into Emacs 29+; the elpa-eglot package on Emacs 28)
(with-eval-after-load 'eglot
  (add-to-list 'eglot-server-programs (cons canvas-ls-modes #'canvas-ls-eglot-contact)))

(defun canvas-ls-learn-workspace (&optional folder)
  "Tune canvas-ls's model on the repository of FOLDER (default: the project's root) in the background.
The server trains at the lowest CPU priority and says when the repository's files use the new model."
  (interactive (list (read-directory-name "Learn folder: " (canvas-ls--project-root))))
  (let* ((server (eglot-current-server))
         (root (expand-file-name (or folder (canvas-ls--project-root)))))
    (unless server (user-error "canvas-ls: no eglot server in this buffer"))
    (let ((result (jsonrpc-request server :workspace/executeCommand
                                   (list :command "canvas-ls.learnWorkspace"
                                         :arguments (vector (list :folder (concat "file://" root)))))))
      (if (plist-get result :error)
          (user-error "canvas-ls: %s" (plist-get result :error))
        (message "canvas-ls: learning %s for %s min in the background"
                 (plist-get result :workspace) (plist-get result :minutes)))
      result)))

(defvar canvas-ls--status nil
  "The last `canvas/status' the server answered (a plist), for the mode line.")

(defun canvas-ls--server ()
  "This buffer's eglot server when it is canvas-ls, else nil."
  (let ((server (and (fboundp 'eglot-current-server) (eglot-current-server))))
    (and server (string-match-p "canvas-ls\\|canvas_ls" (format "%s" (process-command (jsonrpc--process server))))
         server)))

(defun canvas-ls-refresh-status (&optional wait)
  "Ask the server for `canvas/status' (in the background unless WAIT) and redraw the mode line."
  (let ((server (canvas-ls--server)))
    (when server
      (if wait
          (progn (setq canvas-ls--status (jsonrpc-request server :canvas/status nil))
                 (force-mode-line-update))
        (jsonrpc-async-request server :canvas/status nil
                               :success-fn (lambda (status) (setq canvas-ls--status status)
                                             (force-mode-line-update t)))))))

(defun canvas-ls-mode-line ()
  "The mode line's note: the engine while it is not ready, else the last request's outcome: \"shown\", or the
reason nothing was (\"low confidence\", \"inside a word\"...; an unknown reason shows as its text)."
  (let* ((status canvas-ls--status)
         (engine (plist-get (plist-get status :engine) :state))
         (last (and status (> (length (plist-get status :last)) 0) (aref (plist-get status :last) 0))))
    (cond ((null status) "")
          ((not (equal engine "ready")) (format " canvas-ls:%s" engine))
          ((null last) " canvas-ls")
          ((eq (plist-get last :shown) t) " canvas-ls:shown")
          (t (format " canvas-ls:%s" (or (plist-get last :why) "nothing shown"))))))

(defun canvas-ls-complete ()
  "Ask canvas-ls for a suggestion at point now (an Invoked request: shown whatever the model's confidence).
When nothing comes, the server says why in the echo area."
  (interactive)
  (completion-at-point)
  (canvas-ls-refresh-status))

(defun canvas-ls-status ()
  "Show the engine, the last requests and why nothing was shown (the server's `canvas/status')."
  (interactive)
  (unless (canvas-ls--server) (user-error "canvas-ls: no canvas-ls server in this buffer"))
  (canvas-ls-refresh-status t)
  (let* ((status canvas-ls--status)
         (reasons (plist-get status :reasons))
         (engine (plist-get status :engine))
         (lines (list (format "canvas-ls: engine %s (%s)" (plist-get engine :state) (plist-get engine :model))
                      (format "%d requests, %d showed a suggestion"
                              (plist-get status :requests) (plist-get status :shown)))))
    (seq-do (lambda (silent)
              (let ((why (plist-get silent :why)))
                (push (format "  %4d nothing shown: %s" (plist-get silent :count)
                              (or (plist-get (seq-find (lambda (r) (equal (plist-get r :why) why)) reasons) :words)
                                  why))
                      lines)))
            (plist-get status :silent))
    (seq-do (lambda (last)
              (push (format "last%s: %s%s" (if (eq (plist-get last :invoked) t) " (asked)" "")
                            (if (eq (plist-get last :shown) t) "shown" (or (plist-get last :why) "nothing shown"))
                            (if (stringp (plist-get last :detail)) (concat "; " (plist-get last :detail)) ""))
                    lines))
            (seq-take (plist-get status :last) 5))
    (message "%s" (string-join (nreverse lines) "\n"))))

(defvar canvas-ls-mode-map
  (let ((map (make-sparse-keymap)))
    (define-key map (kbd "M-\\") #'canvas-ls-complete)
    map)
  "Keys of `canvas-ls-mode': M-\\ asks for a suggestion (as VS Code's Alt+\\).")

(defvar canvas-ls--timer nil)

;;;###autoload
(define-minor-mode canvas-ls-mode
  "canvas-ls in this buffer: M-\\ asks for a suggestion, the mode line says why none was shown."
  :lighter (:eval (canvas-ls-mode-line))
  :keymap canvas-ls-mode-map
  (when (and canvas-ls-mode (null canvas-ls--timer))
    (setq canvas-ls--timer
          (run-with-idle-timer 1 t (lambda () (when canvas-ls-mode (canvas-ls-refresh-status)))))))

(add-hook 'eglot-managed-mode-hook
          (lambda () (when (canvas-ls--server) (canvas-ls-mode (if (bound-and-true-p eglot--managed-mode) 1 -1)))))

(defun canvas-ls--project-root ()
  (let ((project (project-current)))
    (if project (project-root project) default-directory)))

;;; lsp-mode
(with-eval-after-load 'lsp-mode
  (lsp-register-client
   (make-lsp-client
    :new-connection (lsp-stdio-connection (lambda () canvas-ls-command))
    :activation-fn (lsp-activate-on "python" "go" "javascript" "typescript" "rust" "c" "cpp" "java" "lua")
    :initialization-options (lambda () canvas-ls-initialization-options)
    :add-on? t  ; alongside your language's own server
    :server-id 'canvas-ls)))

(provide 'canvas-ls)
;;; canvas-ls.el ends here
